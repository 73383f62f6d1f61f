"""How many module boundaries one pure triage call crosses (issue 23's "hop count"), traced with ``sys.setprofile``.

For each case a :func:`tpassrun.plan.triage.triage` call is traced with bench/hopstrace/hopcount.py's
``Recorder``, the counter bench/hops_swap.py runs in every process of a planned swap: every Python call whose callee
lives in another file of the project than the nearest project frame below it is a move (a hop down), every return
into another file a move back up; a move between packages is one whose two files sit in different packages (in the
flat tree every module was its own). Only the project's own files count (tpassrun/, rendezvous/, health/); the
standard library and torch are seen through. The issue measured the flat layout before the renovation with a
counter of its own: 8 files, 23 moves, 11 back up for a triage call.

    python bench/hops.py            # a table: case, files, moves, back up, the files in order of first entry

It measures the tree whose ``tpassrun`` the interpreter imports, with that tree's tests/test_triage.py fixtures
(the names through it, so an older tree runs this too). Before the renovation (the tree before c0a17c6; an
interpreter importing tpassrun from it, bench/README.md's "Hop counts" says how it was made)::

    git worktree add ../tpassrun-before c0a17c6^
    ../tpassrun-before/.venv/bin/python bench/hops.py
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "hopstrace"))

from hopcount import Recorder, summarise, window

import tpassrun

TREE = os.path.dirname(os.path.dirname(os.path.abspath(tpassrun.__file__)))    # the tree under measure, not this one
sys.path.insert(0, os.path.join(TREE, "tests"))


def trace(fn: Callable[[], Any]) -> tuple[list[str], int, int, int]:
    """The files entered (in order), moves, back up, moves between packages of one call of ``fn``."""
    recorder = Recorder(TREE)
    sys.setprofile(recorder)
    try:
        fn()
    finally:
        sys.setprofile(None)
    got = summarise(window(recorder.moves, recorder.names, float("-inf"), float("inf")))
    return recorder.names, got["moves"], got["back_up"], got["between_packages"]


def cases() -> dict[str, Callable[[], Any]]:
    import test_triage as t  # its fixtures; the names through it, so an older tree runs this too
    SlotView, triage, Failure = t.SlotView, t.triage, t.Failure

    dead = Failure(node="a", slot=1, rank=1, code=-9, step=9, light=True, generation=2)
    dead_view = t.view(t.RUNNING[0], SlotView("a", 1, 1, "dead", True, 9), t.RUNNING[2], t.SPARE)
    quiet, tainted = t.seen(), t.seen(taints=(t.taint(),))
    failed = t.seen(view=dead_view, failures=(("a-1", dead),))
    return {
        "nothing to do": lambda: triage(quiet),
        "a taint -> a planned swap": lambda: triage(tainted),
        "a dead rank -> an unplanned swap": lambda: triage(failed),
    }


def main() -> None:
    print("| case | files | moves | back up | moves between packages | files, in order of first entry |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, fn in cases().items():
        fn()                                    # imports and caches out of the count
        files, moves, ups, between = trace(fn)
        print(f"| {name} | {len(files)} | {moves} | {ups} | {between} | {', '.join(files)} |")


if __name__ == "__main__":
    main()
