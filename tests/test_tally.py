"""The run's tally (tpassrun/ops/tally.py), a reducer of its own, against the event logs of real runs
(tests/golden/events/, each made by ``bench/restart_cost.py --keep DIR``: 2 ranks of a script, rank 1 SIGKILLed
from outside at step 15 of 30, 0.5 s a step), and the summary, ``tpassctl status``, ``tpassctl events`` and the
Prometheus gauges saying the same from it.

- ``restart-plain-script``: ``tests/plain_train.py`` (no worker API), 1 spare, ``--max-restarts 1``: the whole
  group restarted and ran steps 0-15 again. By the stopwatch the failure cost 12.46 s (torchrun: 10.49 s; the
  same 16 steps run again). tpassrun sees the restart's own 122 ms (the death -> the new workers started), not
  the new workers' start-up nor the steps they ran again: it says "at least", and "unknown", never 0 / 100%.
- ``restart-worker-api``: ``examples/train_ddp.py`` (the worker API), no spare, ``--max-restarts 1``.
- ``recovery-live``: the same script with a spare: recovered live. ``failure-no-restart``: no spare, no restart.
"""

from __future__ import annotations

import io
import json
import os
from types import SimpleNamespace

import pytest

from tpassrun.ops.console import cost_line, summary_lines
from tpassrun.ops.ctl_events import print_events
from tpassrun.ops.events import read_events
from tpassrun.ops.tally import HOW_TO_KNOW, tally_of

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "events")


def _log(name: str) -> list[dict]:
    return read_events(os.path.join(GOLDEN, f"{name}.jsonl"))


def test_a_restart_of_a_script_without_the_worker_api_counts_its_own_time_and_says_the_rest_is_unknown():
    t = tally_of(_log("restart-plain-script"))
    assert len(t.restarts) == 1 and not t.known and t.code == 0
    r = t.restarts[0]
    assert r.redone is None and r.redone_s is None and r.why == "rank 1 (local 1) exited with -9"
    assert round(r.down_s, 3) == 0.122            # the death (worker_exit) -> the new group's workers_started
    assert t.goodput is None and t.restart_redone is None and t.steps_redone == 0
    assert summary_lines(t, 0) == [
        "summary: exit code 0, wall time 32.51 s",
        "summary: 0 swap(s), 0 recover(ies), 1 whole-group restart(s), 0 hang kill(s)",
        "summary: time lost to failures at least 122 ms, steps lost unknown, steps redone 0, goodput unknown",
        f"summary: unknown: {HOW_TO_KNOW}"]
    doc = t.to_json()
    assert doc["known"] is False and doc["goodput_pct"] is None and doc["steps_lost"] is None
    assert doc["unknown_because"] == HOW_TO_KNOW and doc["restarts"] == 1 and doc["exit_code"] == 0


@pytest.mark.parametrize("name", ["restart-plain-script", "restart-worker-api", "recovery-live", "failure-no-restart"])
def test_status_events_and_metrics_say_what_the_summary_says(name, tmp_path, monkeypatch):
    events = _log(name)
    t = tally_of(events)
    summary = summary_lines(t, t.code)
    # tpassctl status: the costs line is the summary's third, from the same reducer over the same log
    assert f"summary: {cost_line(t, t.code)}" == summary[2]
    # tpassctl events: the launcher's lines, the summary the same
    entry = SimpleNamespace(run_id="r", event_log=os.path.join(GOLDEN, f"{name}.jsonl"), pid=1)
    out = io.StringIO()
    monkeypatch.setenv("COLUMNS", "400")
    assert print_events(entry, follow=False, raw=False, out=out) == 0
    printed = [line.split("] ", 2)[-1] for line in out.getvalue().splitlines() if "summary: " in line]
    assert printed == summary
    # the Prometheus gauges: fed the same events through the console's describer
    pytest.importorskip("prometheus_client")
    from tpassrun.ops.metrics import AgentMetrics

    metrics = AgentMetrics(SimpleNamespace(slots=None, generation=None))     # type: ignore[arg-type]
    for ev in events:
        metrics(ev)
    gauges = {m.name: m.samples[0].value for m in metrics.collect() if m.samples and not m.samples[0].labels}
    goodput = t.goodput
    assert gauges["tpassrun_goodput_ratio"] == (-1.0 if goodput is None else goodput / 100.0)
    assert gauges["tpassrun_time_lost_seconds"] == pytest.approx(t.lost)
    assert gauges["tpassrun_costs_known"] == (1.0 if t.known else 0.0)
    steps_lost = t.restart_redone
    assert gauges["tpassrun_steps_lost"] == (-1.0 if steps_lost is None else steps_lost)
    assert gauges["tpassrun_whole_group_restarts"] == len(t.restarts)


def test_the_tally_is_the_same_fed_one_event_at_a_time_or_folded():
    events = _log("restart-plain-script")
    from tpassrun.ops.console import Describer

    d = Describer()
    for ev in events:
        d.describe(ev)
    assert d.tally.to_json() == tally_of(events).to_json()
    assert json.dumps(d.tally.to_json())     # JSON as tpassctl status --json gives it


def test_a_restart_with_the_worker_api_counts_its_time_the_steps_run_again_and_the_goodput():
    """``restart-worker-api``: examples/train_ddp.py, no spare, ``--max-restarts 1``, rank 1 SIGKILLed after step
    15: the stopwatch says the failure cost 13.53 s (torchrun: 11.97 s), 16 steps run again. The summary: 12.70 s,
    15 steps lost (the step in flight counts as not done), goodput 62.2%."""
    t = tally_of(_log("restart-worker-api"))
    assert t.known and len(t.restarts) == 1 and t.restarts[0].resumed_at == 0 and t.restart_redone == 15
    assert summary_lines(t, 0)[2] == \
        "summary: time lost to failures 12.70 s, steps lost 15, steps redone 0, goodput 62.2%"
    assert t.to_json()["unknown_because"] is None and t.to_json()["goodput_pct"] == 62.2


def test_a_live_recovery_and_a_failed_run():
    """``recovery-live``: examples/train_ddp.py with a spare: the SIGKILLed rank recovered live (a pause, no
    restart). ``failure-no-restart``: no spare, ``--max-restarts 0``: the run failed and claims no goodput."""
    live = tally_of(_log("recovery-live"))
    assert [(s.kind, s.redone) for s in live.swaps] == [("unplanned", 0)] and not live.restarts and live.known
    assert summary_lines(live, 0)[1:] == [
        "summary: 0 swap(s), 1 recover(ies) (pause 554 ms), 0 whole-group restart(s), 0 hang kill(s)",
        "summary: time lost to failures 554 ms, steps lost 0, steps redone 0, goodput 97.5%"]
    failed = tally_of(_log("failure-no-restart"))
    assert failed.code == 1 and not failed.restarts and not failed.swaps
    assert summary_lines(failed, 1)[2].endswith("goodput not counted: the run failed (its progress since the "
                                                "script's last checkpoint is lost)")
