"""The module graph: no import circle inside tpassrun (imports for annotations under ``if TYPE_CHECKING:`` and
imports inside functions count too: a circle of types is still a circle), and no upward import
(``rendezvous``/``health`` never import the rest of tpassrun)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"tpassrun": ROOT / "tpassrun", "tpassrun.rendezvous": ROOT / "rendezvous",
            "tpassrun.health": ROOT / "health"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, path in PACKAGES.items():
        for f in sorted(path.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    for sub in ("adapters", "scheduler"):
        for f in sorted((ROOT / "tpassrun" / sub).glob("*.py")):
            out[f"tpassrun.{sub}" if f.stem == "__init__" else f"tpassrun.{sub}.{f.stem}"] = f
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
    for module, deps in graph().items():
        if any(module == p or module.startswith(p + ".") for p in ("tpassrun.rendezvous", "tpassrun.health")):
            own = module.split(".")[:2]
            up = [d for d in deps if d.split(".")[:2] != own]
            assert up == [], f"{module} imports {up}"


def test_the_agent_is_not_imported_by_its_parts():
    importers = sorted(m for m, deps in graph().items() if "tpassrun.agent" in deps)
    assert importers == ["tpassrun.cli"] or set(importers) <= {"tpassrun.cli", "tpassrun.config"}, importers


# ---------------------------------------------------------------------------------------------- DESIGN.md's map
DESIGN = ROOT / "docs" / "DESIGN.md"
_EXTERNAL = {"stdlib", "aetcd", "torch", "pynvml"}


def _layout() -> list[tuple[list[str], set[str] | None]]:
    """DESIGN.md's Layout table: (the modules a row names, the tpassrun modules it may import; None: any)."""
    import re

    text = DESIGN.read_text()
    table = text[text.index("## Layout"):]
    table = table[: table.index("\n\n", table.index("| --- |"))]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue   # the heading, the header row, its rule
        modules = []
        for path in re.findall(r"`((?:tpassrun|rendezvous|health)/[^`]*)`", cells[0]):
            path = path.removesuffix(".py").removesuffix("/")
            name = "tpassrun." + path if not path.startswith("tpassrun") else path.replace("/", ".")
            modules.append("tpassrun" if name == "tpassrun.__init__" else name)
        may = cells[-1]
        if may.startswith("everything"):
            rows.append((modules, None))
            continue
        allowed = set()
        for token in re.sub(r"\([^)]*\)", "", may).split(","):
            word = token.strip().split(" ")[0] if token.strip() else ""
            if word and word not in ("nothing", "-") and word not in _EXTERNAL:
                allowed.add("tpassrun." + word)
        rows.append((modules, allowed))
    return rows


def _row_of(module: str, rows: list[tuple[list[str], set[str] | None]]) -> set[str] | None | bool:
    for names, allowed in rows:
        if any(module == n or (n != "tpassrun" and module.startswith(n + ".")) for n in names):
            return allowed
    return False


def _within(dep: str, allowed: set[str]) -> bool:
    return any(dep == a or dep.startswith(a + ".") for a in allowed)


def test_design_layout_names_every_module_and_what_it_may_import():
    rows = _layout()
    missing, extra = [], []
    for module, deps in graph().items():
        allowed = _row_of(module, rows)
        if allowed is False:
            missing.append(module)
            continue
        if allowed is None or module.startswith(("tpassrun.rendezvous", "tpassrun.health", "tpassrun.adapters.")):
            continue   # the CLI may import anything; the subpackages are checked by test_no_upward_import
        bad = sorted(d for d in deps if d != "tpassrun" and not _within(d, allowed))
        if bad:
            extra.append(f"{module} imports {bad}")
    assert missing == [], f"no row in docs/DESIGN.md's Layout table for {missing}"
    assert extra == [], "imports docs/DESIGN.md's Layout table does not allow: " + "; ".join(extra)


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
    """``tpassrun/config.py`` did ``from health import Policy``: fine from the repository's root, where
    ``health/`` happens to be importable, a ``ModuleNotFoundError`` traceback for every ``--health-config``
    from an installed tpassrun."""
    files = [p for p in _modules().values()]
    files += sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    bad = {str(p.relative_to(ROOT)): hits for p in files if (hits := bare_imports(p.read_text()))}
    assert bad == {}, bad
