"""The house's measures (issue 40), for closing notes: the largest function and class, the `assert ... is not None`
in tpassrun/agent/, cross-package imports past a door (tests/test_doors.py holds them), the `# noqa` comments.

    .venv/bin/python scripts/measures.py [REPO] [-v]     (-v: every import past a door)
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(next((a for a in sys.argv[1:] if a != "-v"), ".")).resolve()
SOURCES = sorted([*(ROOT / "tpassrun").rglob("*.py"), *(ROOT / "rendezvous").glob("*.py"), *(ROOT / "health").glob("*.py")])


def module_of(p: Path) -> str:
    rel = p.relative_to(ROOT).with_suffix("").parts
    if rel[0] in ("rendezvous", "health"):
        rel = ("tpassrun", *rel)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def package_of(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) >= 2 and (len(parts) > 2 or (ROOT / "tpassrun" / parts[1]).is_dir() or parts[1] in ("rendezvous", "health")):
        return parts[1]
    return "top"


funcs, classes = [], []
past = total = 0
pasts = []
for p in SOURCES:
    tree = ast.parse(p.read_text())
    mod = module_of(p)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            funcs.append((n.end_lineno - n.lineno + 1, f"{p.relative_to(ROOT)}:{n.name}"))
        elif isinstance(n, ast.ClassDef):
            classes.append((n.end_lineno - n.lineno + 1, f"{p.relative_to(ROOT)}:{n.name}"))
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").startswith("tpassrun."):
            target = n.module or ""
            tp = package_of(target)
            if tp == package_of(mod) or tp == "top":
                continue
            total += 1
            door = target.split(".")[:2]
            if target not in (".".join(door), ".".join(door) + ".api"):
                past += 1
                pasts.append(f"{mod} -> {target}")
funcs.sort(reverse=True)
classes.sort(reverse=True)
agent_asserts = 0
for p in sorted((ROOT / "tpassrun" / "agent").rglob("*.py")):
    agent_asserts += len(re.findall(r"assert [^\n]*is not None", p.read_text()))
noqa = 0
for p in [*ROOT.glob("tpassrun/**/*.py"), *ROOT.glob("rendezvous/*.py"), *ROOT.glob("health/*.py"), *ROOT.glob("tests/*.py"),
          *ROOT.glob("bench/**/*.py"), *ROOT.glob("examples/**/*.py"), *ROOT.glob("scripts/**/*.py")]:
    noqa += 0 if p.name == "measures.py" else p.read_text().count("# noqa")   # (not this file's own)
print(f"largest function: {funcs[0][0]} lines ({funcs[0][1]}); next {funcs[1][0]} ({funcs[1][1]})")
print(f"largest class: {classes[0][0]} lines ({classes[0][1]}); next {classes[1][0]} ({classes[1][1]})")
print(f"'assert ... is not None' in tpassrun/agent/: {agent_asserts}")
print(f"cross-package imports (from-import statements): {total}, past a door: {past}")
print(f"'# noqa' comments (tpassrun, rendezvous, health, tests, bench, examples, scripts): {noqa}")
if "-v" in sys.argv:
    print("\n".join(pasts))
