"""Moves between the project's modules in a live process: the recorder ``sitecustomize.py`` installs, and the sums.

A *move* is a Python call whose frame lives in another project file than the nearest project frame below it on the
same thread (``down``), or a return from a project frame to the nearest project frame below it that lives in
another file (``up``, "back up"). Frames of any other file (the standard library, torch, the user's script,
``<string>``) are seen through: tpassrun -> functools -> tpassrun is one move between the two tpassrun files, and a
call from the script into ``tpassrun`` is no move. asyncio's event loop is the bottom of a stack, as a thread's start
is: a task resumed or a callback run by the loop has no caller (else every resume of every task would count as a
move from the file that called ``asyncio.run``, the agent's); an ``await`` between two project coroutines is a call. A move between packages is one whose two files sit in different
packages: ``tpassrun/<pkg>/...`` is package ``tpassrun/<pkg>``, ``rendezvous/...`` and ``health/...`` are theirs,
and a module directly in ``tpassrun/`` (every module of the flat tree before c0a17c6) is its own.

Self-contained on purpose (the standard library only, no ``tpassrun`` import): the same file traces the tree before
the package move, where nothing of the new layout exists.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable

ENV = "TPASSRUN_HOPS_TRACE"     # the output directory; spelled as tpassrun.settings.envnames.TPASSRUN_HOPS_TRACE
PARTS = ("tpassrun", "rendezvous", "health")
LOOP = os.path.join(os.path.dirname(os.__file__), "asyncio") + os.sep     # not imported: the tracer starts first
BOTTOM = -1                                                               # a frame of the event loop


def roots_of(tree: str) -> tuple[str, ...]:
    """The project's source directories of a source tree, each ending in a separator."""
    return tuple(os.path.join(os.path.abspath(tree), part) + os.sep for part in PARTS)


def package(rel: str) -> str:
    """tpassrun/swapper/coordinator.py -> tpassrun/swapper; tpassrun/swap.py -> itself; rendezvous/etcd.py -> rendezvous."""
    parts = rel.split("/")
    if parts[0] != "tpassrun":
        return parts[0]
    return "/".join(parts[:2]) if len(parts) > 2 else rel


class Recorder:
    """A ``sys.setprofile`` function that appends ``(time, from, to, up)`` for every move, files by index in ``names``."""

    def __init__(self, tree: str, clock: Callable[[], float] = time.time) -> None:
        self.tree = os.path.abspath(tree)
        self.roots = roots_of(tree)
        self.clock = clock
        self.names: list[str] = []
        self.moves: list[tuple[float, int, int, int]] = []
        self._ids: dict[str, int | None] = {}

    def _id(self, filename: str) -> int | None:
        """The file's index in ``names``, ``None`` for a file seen through, ``BOTTOM`` for the event loop's."""
        try:
            return self._ids[filename]
        except KeyError:
            pass
        path = os.path.abspath(filename)
        found: int | None = None
        if path.startswith(self.roots):
            found = len(self.names)
            self.names.append(os.path.relpath(path, self.tree).replace(os.sep, "/"))
        elif path.startswith(LOOP):
            found = BOTTOM
        self._ids[filename] = found
        return found

    def _below(self, frame: Any) -> int | None:
        while frame is not None:
            here = self._id(frame.f_code.co_filename)
            if here is not None:
                return None if here == BOTTOM else here
            frame = frame.f_back
        return None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" and event != "return":
            return
        here = self._id(frame.f_code.co_filename)
        if here is None or here == BOTTOM:
            return
        below = self._below(frame.f_back)
        if below is not None and below != here:
            if event == "call":
                self.moves.append((self.clock(), below, here, 0))
            else:
                self.moves.append((self.clock(), here, below, 1))

    def install(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def dump(self, path: str, meta: dict[str, Any]) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({**meta, "names": self.names, "moves": self.moves}, f)
        os.replace(tmp, path)


def window(moves: Iterable[tuple[float, int, int, int]], names: list[str], start: float,
           end: float) -> list[tuple[str, str, int]]:
    """The moves between ``start`` and ``end`` (wall clock, inclusive), by file name."""
    return [(names[a], names[b], up) for t, a, b, up in moves if start <= t <= end]


def summarise(moves: Iterable[tuple[str, str, int]], top: int = 8) -> dict[str, Any]:
    """Files, distinct crossings (file -> file, down) and of them between packages, moves (down), back up, moves
    between packages, and the most frequent crossings, file to file and package to package."""
    files: set[str] = set()
    down = ups = between = 0
    crossings: Counter[tuple[str, str]] = Counter()
    pkg_crossings: Counter[tuple[str, str]] = Counter()
    for a, b, up in moves:
        files.update((a, b))
        if up:
            ups += 1
            continue
        down += 1
        crossings[a, b] += 1
        if package(a) != package(b):
            between += 1
            pkg_crossings[package(a), package(b)] += 1
    return {"files": len(files), "crossings": len(crossings), "package_crossings": len(pkg_crossings), "moves": down, "back_up": ups, "between_packages": between,
            "top": [[a, b, n] for (a, b), n in crossings.most_common(top)],
            "top_packages": [[a, b, n] for (a, b), n in pkg_crossings.most_common(top)]}
