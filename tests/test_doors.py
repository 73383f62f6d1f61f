"""Each package is entered by its door (its ``__init__``, or ``api.py``), and importing one changes nothing.

- Cross-package imports go through a door: no ``from tpassrun.<pkg>.<module> import`` from another package (the
  name goes into the package's ``__all__``, or becomes the importer's own). A door that would import something heavy
  or circular names it in ``TYPE_CHECKING`` and imports it on first use (a module ``__getattr__``, as
  ``tpassrun.rendezvous`` does).
- No module writes the process environment at import (``tpassrun.agent`` did, for gRPC: now ``tpassrun.cli`` does
  it, for its own process, before the agent is imported).
- A module's logger is named after its package (``tpassrun.<package>...``: ``__name__`` is), so a log line says
  where it came from.
- One endpoint grammar: ``split_endpoint`` is defined once (``tpassrun.rendezvous``).
"""

from __future__ import annotations

import ast
import subprocess
import sys

from test_import_graph import ROOT, _modules, cross_package_imports, package_of


def past_a_door() -> list[str]:
    """``module -> imported module`` for every ``from tpassrun.<pkg>.<module> import ...`` in another package."""
    found = []
    for module, node in cross_package_imports():
        target = node.module or ""
        if package_of(target) == "top":
            continue
        door = ".".join(target.split(".")[:2])
        if target not in (door, door + ".api"):
            found.append(f"{module} -> {target}")
    return found


def test_cross_package_imports_go_through_doors():
    found = past_a_door()
    assert found == [], (
        f"{len(found)} cross-package imports past a door: import from the package's __init__ (add the name to its "
        "__all__) instead\n" + "\n".join(sorted(found)))


def test_every_door_exports_what_it_names():
    """Each name in a door's ``__all__`` resolves (a lazy door's table and its ``TYPE_CHECKING`` imports agree); in
    a process of its own, which imports every package."""
    doors = sorted(module for module, path in _modules().items() if path.name == "__init__.py")
    probe = ("import importlib, sys\n"
             f"missing = [f'{{m}}.{{n}}' for m in {doors!r} for n in getattr(importlib.import_module(m), '__all__', ())\n"
             "           if not hasattr(sys.modules[m], n)]\n"
             "assert not missing, missing\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_importing_tpassrun_writes_no_environment():
    probe = ("import os; before = dict(os.environ)\n"
             "import tpassrun, tpassrun.cli, tpassrun.agent, tpassrun.worker, tpassrun.ops.ctl\n"
             "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
             "assert not changed, changed\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]


def _logger_names(tree: ast.AST) -> list[str | None]:
    """The name given to each ``logging.getLogger(...)`` at module level (None: ``__name__``)."""
    names: list[str | None] = []
    for node in getattr(tree, "body", []):
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "getLogger" \
                    and call.args:
                arg = call.args[0]
                if isinstance(arg, ast.Name) and arg.id == "__name__":
                    names.append(None)
                elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.append(arg.value)
    return names


def test_every_logger_is_named_after_its_package():
    wrong = []
    for module, path in _modules().items():
        package = package_of(module)
        prefix = "tpassrun" if package == "top" else f"tpassrun.{package}"
        for name in _logger_names(ast.parse(path.read_text())):
            if name is not None and name != prefix and not name.startswith(prefix + "."):
                wrong.append(f"{module}: getLogger({name!r})")
    assert wrong == [], wrong


def test_one_split_endpoint():
    defined = [module for module, path in _modules().items()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "split_endpoint"]
    assert defined == ["tpassrun.rendezvous.config"]


def _action_vocabularies() -> dict[str, list[str]]:
    """class name -> the modules whose action union (a module-level ``...Action = A | B`` or ``Union[A, B]``) names it."""
    found: dict[str, list[str]] = {}
    for module, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and node.targets[0].id.endswith("Action"):
                names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id != "Union"}
                for name in names:
                    found.setdefault(name, []).append(module)
    return found


def test_action_vocabularies_are_named_per_package():
    """Each package's actions are its own: the triage's PutTaint and the scheduler watcher's were two classes of one
    name (and Say), told apart only by where they were imported from."""
    shared = {name: mods for name, mods in _action_vocabularies().items() if len({package_of(m) for m in mods}) > 1}
    assert shared == {}
