"""How many module boundaries one pure triage call crosses (issue 23's "hop count"), traced with ``sys.setprofile``.

For each case a :func:`tpassrun.plan.triage.triage` call is traced; every Python call whose callee lives in another
file of the project than its caller is a move (a hop down), every return into another file a move back up; a move
between packages is one whose two files sit in different packages (in the flat tree every module was its own). Only
the project's own files count (tpassrun/, rendezvous/, health/); the standard library and torch are seen through.
The issue measured the flat layout before the renovation: 8 files, 23 moves, 11 back up for a triage call.

    python bench/hops.py            # a table: case, files, moves, back up, the files in order of first entry

Before the renovation (the tree before c0a17c6, same script, same fixtures)::

    git worktree add /tmp/old c0a17c6^ && cp bench/hops.py /tmp/old/bench/ && PYTHONPATH=/tmp/old python /tmp/old/bench/hops.py
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

import tpassrun  # noqa: E402

ROOTS = tuple(os.path.dirname(os.path.abspath(m)) + os.sep for m in (tpassrun.__file__,))


def ours(path: str) -> str | None:
    path = os.path.abspath(path)
    for root in ROOTS:
        if path.startswith(root):
            return os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))
    return None


def package(path: str) -> str:
    """tpassrun/plan/swap.py -> tpassrun/plan; a flat module (tpassrun/swap.py) is its own package."""
    head, tail = os.path.split(path)
    return head if head.count(os.sep) >= 1 else path


def trace(fn: Callable[[], Any]) -> tuple[list[str], int, int, int]:
    files: list[str] = []
    moves = ups = between = 0
    stack: list[str | None] = []

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal moves, ups, between
        if event not in ("call", "return"):
            return
        here = ours(frame.f_code.co_filename)
        if event == "call":
            caller = stack[-1] if stack else None
            stack.append(here)
            if here is not None:
                if here not in files:
                    files.append(here)
                if caller is not None and caller != here:
                    moves += 1
                    between += package(caller) != package(here)
        else:
            done = stack.pop() if stack else None
            back = stack[-1] if stack else None
            if done is not None and back is not None and back != done:
                ups += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files, moves, ups, between


def cases() -> dict[str, Callable[[], Any]]:
    import test_triage as t                     # its fixtures; the names through it, so an older tree runs this too
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
