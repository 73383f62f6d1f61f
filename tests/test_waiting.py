"""What the run waits for, with its age, in the live view of ``tpassrun --tui`` (tpassrun/ops/waiting.py): the
console says a wait every few seconds; the panel shows the newest one and counts its age on every redraw, until
what it waited for came."""

from __future__ import annotations

import io

from rich.console import Console

from tpassrun.ops.tui import render_status
from tpassrun.ops.waiting import WaitNote


def _frame(doc: dict, now: float) -> str:
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render_status(doc, now=now, width=120, height=20))
    return out.getvalue()


def test_a_pool_wait_is_shown_with_its_age_until_the_claim_then_the_cold_start_until_the_recovery():
    note = WaitNote()
    note({"event": "pool_waiting", "time": 1000.0, "lost_node": "rank 1 (died at step 9, generation 0)",
          "pool": "gpu-pool", "waited": 5.0, "wait_limit": 60.0, "reason": "all 1 pool node(s) are claimed"})
    doc = {"run_id": "r", "waiting": note.doc()}
    frame = _frame(doc, now=1012.0)
    assert ("… waiting 17s: rank 1 (died at step 9, generation 0): pool gpu-pool (--pool-wait 60 s): all 1 pool "
            "node(s) are claimed") in frame, frame
    note({"event": "pool_claimed", "time": 1020.0, "pool": "gpu-pool", "pool_node": "vm-4242-ab12", "waited": 25.0})
    assert "… waiting 30s: pool node vm-4242-ab12 claimed from pool gpu-pool: its spares start (a joiner from cold)" in \
        _frame({"run_id": "r", "waiting": note.doc()}, now=1025.0)
    note({"event": "swap_resumed", "time": 1040.0})
    assert note.doc() is None and "waiting" not in _frame({"run_id": "r", "waiting": note.doc()}, now=1041.0)


def test_waiting_for_nodes_counts_from_the_first_join():
    note = WaitNote()
    note({"event": "waiting_for_nodes", "time": 500.0, "seconds": 10.0, "joined": 1, "needed": 2})
    assert "… waiting 12s: nodes: 1 of 2 joined" in _frame({"run_id": "r", "waiting": note.doc()}, now=502.0)
    note({"event": "generation_joined", "time": 505.0})
    assert note.doc() is None
