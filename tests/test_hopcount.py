"""bench/hopstrace/hopcount.py, the counter behind bench/hops_swap.py's hop counts: pure, one process, no network."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "hopstrace"))

import hopcount  # noqa: E402

from tpassrun.settings import envnames  # noqa: E402


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moves_between_files_are_counted_and_other_code_is_seen_through(tmp_path: Path) -> None:
    """A call chain tpassrun/top.py -> tpassrun/plan/a.py -> (a file outside the project) -> tpassrun/plan/b.py,
    each returning: two moves down (top -> a, and a -> b through the foreign frame), two back up; a call inside
    one file and the foreign file itself count nothing."""
    (tmp_path / "tpassrun" / "plan").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "tpassrun" / "plan" / "b.py").write_text("def leaf():\n    return 1\n")
    (tmp_path / "elsewhere" / "lib.py").write_text("def through(f):\n    return f()\n")
    (tmp_path / "tpassrun" / "plan" / "a.py").write_text(
        "def helper():\n    return 0\n\ndef mid(lib, b):\n    helper()\n    return lib.through(b.leaf)\n")
    (tmp_path / "tpassrun" / "top.py").write_text("def run(a, lib, b):\n    return a.mid(lib, b)\n")
    b = _load(tmp_path / "tpassrun" / "plan" / "b.py", "hop_b")
    lib = _load(tmp_path / "elsewhere" / "lib.py", "hop_lib")
    a = _load(tmp_path / "tpassrun" / "plan" / "a.py", "hop_a")
    top = _load(tmp_path / "tpassrun" / "top.py", "hop_top")

    recorder = hopcount.Recorder(str(tmp_path), clock=lambda: 5.0)
    sys.setprofile(recorder)
    try:
        top.run(a, lib, b)
    finally:
        sys.setprofile(None)

    moves = hopcount.window(recorder.moves, recorder.names, 0.0, 10.0)
    assert moves == [("tpassrun/top.py", "tpassrun/plan/a.py", 0), ("tpassrun/plan/a.py", "tpassrun/plan/b.py", 0),
                     ("tpassrun/plan/b.py", "tpassrun/plan/a.py", 1), ("tpassrun/plan/a.py", "tpassrun/top.py", 1)]
    assert hopcount.window(recorder.moves, recorder.names, 6.0, 10.0) == []
    got = hopcount.summarise(moves)
    assert {k: got[k] for k in ("files", "crossings", "package_crossings", "moves", "back_up", "between_packages")} \
        == {"files": 3, "crossings": 2, "package_crossings": 1, "moves": 2, "back_up": 2, "between_packages": 1}
    assert got["top_packages"] == [["tpassrun/top.py", "tpassrun/plan", 1]]


def test_packages_of_both_layouts() -> None:
    assert hopcount.package("tpassrun/swapper/coordinator.py") == "tpassrun/swapper"
    assert hopcount.package("tpassrun/agent/netwatch/probe.py") == "tpassrun/agent"
    assert hopcount.package("tpassrun/coordinator.py") == "tpassrun/coordinator.py"     # the flat tree: its own
    assert hopcount.package("rendezvous/etcd_io.py") == "rendezvous"
    assert hopcount.package("health/_engine.py") == "health"


def test_the_trace_variable_is_the_one_envnames_declares() -> None:
    """The tracer cannot import tpassrun (it also traces the tree before the package move), so it spells the name
    itself: the two spellings and the one read in sitecustomize.py are the same."""
    assert hopcount.ENV == envnames.TPASSRUN_HOPS_TRACE
    site = (ROOT / "bench" / "hopstrace" / "sitecustomize.py").read_text()
    assert f'os.environ.get("{envnames.TPASSRUN_HOPS_TRACE}")' in site
    assert not any(envnames.TPASSRUN_HOPS_TRACE in p.read_text() for p in (ROOT / "tpassrun").rglob("*.py")
                   if p.name != "envnames.py"), "tpassrun itself never reads the bench's variable"


def test_the_event_loop_is_the_bottom_of_a_stack_and_an_await_is_a_call(tmp_path: Path) -> None:
    """tpassrun/top.py runs ``asyncio.run(a.main())``: the loop resuming ``main`` (tpassrun/plan/a.py) at each step is
    no move from top.py (the agent's event loop would count every task's every resume that way); ``main``
    awaiting ``b.leaf`` is a move down and back up each time the task runs it (here: once)."""
    (tmp_path / "tpassrun" / "plan").mkdir(parents=True)
    (tmp_path / "tpassrun" / "plan" / "b.py").write_text("async def leaf():\n    return 1\n")
    (tmp_path / "tpassrun" / "plan" / "a.py").write_text(
        "import asyncio\n\nasync def main(b):\n    await asyncio.sleep(0)\n    return await b.leaf()\n")
    (tmp_path / "tpassrun" / "top.py").write_text("import asyncio\n\ndef run(a, b):\n    return asyncio.run(a.main(b))\n")
    b = _load(tmp_path / "tpassrun" / "plan" / "b.py", "hop_async_b")
    a = _load(tmp_path / "tpassrun" / "plan" / "a.py", "hop_async_a")
    top = _load(tmp_path / "tpassrun" / "top.py", "hop_async_top")

    recorder = hopcount.Recorder(str(tmp_path))
    sys.setprofile(recorder)
    try:
        assert top.run(a, b) == 1
    finally:
        sys.setprofile(None)

    assert hopcount.window(recorder.moves, recorder.names, 0.0, float("inf")) == [
        ("tpassrun/plan/a.py", "tpassrun/plan/b.py", 0), ("tpassrun/plan/b.py", "tpassrun/plan/a.py", 1)]
