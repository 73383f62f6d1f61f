"""The module graph: no import circle inside tpassrun (imports for annotations under ``if TYPE_CHECKING:`` and
imports inside functions count too: a circle of types is still a circle), and no upward import
(``rendezvous``/``health`` never import the rest of tpassrun but ``schema``, which imports nothing of it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"tpassrun": ROOT / "tpassrun", "tpassrun.rendezvous": ROOT / "rendezvous",
            "tpassrun.health": ROOT / "health"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / "tpassrun").rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    for pkg, path in PACKAGES.items():
        if pkg != "tpassrun":
            for f in sorted(path.glob("*.py")):
                out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    package = module if path.stem == "__init__" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in known else base)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != module}


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            strong(v)
    return out


def _package_level(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package __init__ modules re-export their submodules: an edge into ``tpassrun`` itself is an edge
    into the lazy top-level API, which imports nothing at import time."""
    return {m: {d for d in deps if d != "tpassrun"} for m, deps in g.items()}


def test_no_import_circle():
    assert _cycles(_package_level(graph())) == []


def test_no_upward_import():
    """``tpassrun.schema`` (the one JSON codec, standard library only) is the one package below them."""
    for module, deps in graph().items():
        if any(module == p or module.startswith(p + ".") for p in ("tpassrun.rendezvous", "tpassrun.health")):
            own = module.split(".")[:2]
            up = [d for d in deps if d.split(".")[:2] not in (own, ["tpassrun", "schema"])]
            assert up == [], f"{module} imports {up}"


def test_the_agent_is_not_imported_by_its_parts():
    importers = sorted(m for m, deps in graph().items() if "tpassrun.agent" in deps)
    assert importers == ["tpassrun.cli"] or set(importers) <= {"tpassrun.cli", "tpassrun.launch.config"}, importers


# ------------------------------------------------------------------------------------ docs/layout.toml's map
LAYOUT = ROOT / "docs" / "layout.toml"
TOP = "top"     # tpassrun/__init__.py, cli.py, __main__.py: the console script and the lazy worker API


def package_of(module: str) -> str:
    """The package a module belongs to: ``tpassrun.<package>.<module>``, or ``top`` for the files at the root."""
    parts = module.split(".")
    if len(parts) >= 2 and (len(parts) > 2 or (ROOT / "tpassrun" / parts[1]).is_dir()
                            or parts[1] in ("rendezvous", "health")):
        return parts[1]
    return TOP


def layout() -> dict[str, set[str]]:
    import tomllib

    packages = tomllib.loads(LAYOUT.read_text())["packages"]
    return {name: set(row["may_import"]) for name, row in packages.items()}


def package_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in graph().items():
        mine = package_of(module)
        out.setdefault(mine, set()).update(p for p in map(package_of, deps) if p != mine and p != TOP)
    return out


def test_every_package_has_a_row_and_imports_only_what_it_names():
    rows, g = layout(), package_graph()
    assert sorted(set(g) - set(rows)) == [], f"no row in {LAYOUT.name} for these packages"
    bad = {p: sorted(deps - rows[p]) for p, deps in g.items() if deps - rows[p]}
    assert bad == {}, f"imports {LAYOUT.name} does not allow: {bad}"


def test_the_package_graph_has_no_circle():
    assert _cycles({p: set(d) for p, d in package_graph().items()}) == []


def cross_package_imports() -> list[tuple[str, ast.ImportFrom]]:
    """``(module, node)`` for every absolute ``from tpassrun.... import ...`` naming another package than the module's."""
    found = []
    for module, path in _modules().items():
        mine = package_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tpassrun.")):
                continue
            if package_of(node.module or "") != mine:
                found.append((module, node))
    return found


def test_no_module_imports_another_packages_private_names():
    found = []
    for module, node in cross_package_imports():
        private = [a.name for a in node.names if a.name.startswith("_")]
        if private or any(part.startswith("_") for part in (node.module or "").split(".")):
            found.append(f"{module}: from {node.module} import {', '.join(a.name for a in node.names)}")
    assert found == []


def test_every_package_is_installed():
    """A sub-package missing from pyproject's list imports from the source tree and is absent once installed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    dirs = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tpassrun").rglob("__init__.py")}
    assert sorted(dirs - listed) == []


# ------------------------------------------------------------------------ only importable from the source tree
_INSTALLED_AS = ("rendezvous", "health")   # installed as tpassrun.rendezvous / tpassrun.health, never top level


def bare_imports(source: str) -> list[str]:
    """Absolute imports of ``rendezvous`` or ``health`` as top-level packages in ``source`` (at any depth: inside
    functions too): they resolve only from the repository's root, never from an installed tpassrun."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in _INSTALLED_AS]
    return found


def test_bare_imports_are_found():
    src = "import health\ndef f():\n    from rendezvous.config import X\n    from health import Policy\n" \
          "from tpassrun.health import Policy\nfrom . import health\nimport healthy\n"
    assert bare_imports(src) == ["line 1: health", "line 3: rendezvous.config", "line 4: health"]


def test_no_module_imports_a_subpackage_by_its_source_tree_name():
    """``tpassrun/launch/config.py`` did ``from health import Policy``: fine from the repository's root, where
    ``health/`` happens to be importable, a ``ModuleNotFoundError`` traceback for every ``--health-config``
    from an installed tpassrun."""
    files = [p for p in _modules().values()]
    files += sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    bad = {str(p.relative_to(ROOT)): hits for p in files if (hits := bare_imports(p.read_text()))}
    assert bad == {}, bad
