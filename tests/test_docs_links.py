"""Every relative link in README.md and docs/*.md points to a file of this repository, and every ``#anchor`` to a
heading of the page it names (GitHub's anchor rules). The README sends readers to docs/ pages and to the tests
and benches that show each claim; a page or a test renamed would otherwise leave it pointing nowhere. Pure: reads
files, no network."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)          # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            a = anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            found.add(a if n == 0 else f"{a}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]   # relative only


def test_the_anchor_rule_matches_githubs():
    assert anchor("Where tpassrun differs from torchrun on purpose") == "where-tpassrun-differs-from-torchrun-on-purpose"
    assert anchor("Sharded state: `track_sharded`") == "sharded-state-track_sharded"
    assert anchor("`--rdzv-conf` keys") == "--rdzv-conf-keys"
    assert anchor("The adapters: DeepSpeed, TorchTitan, Megatron") == "the-adapters-deepspeed-torchtitan-megatron"


def test_every_page_has_links():
    assert all(links(p) for p in PAGES if p.name not in ("DESIGN.md", "gpu.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            broken.append(f"{target}: no file {dest}")
        elif frag:
            if dest.suffix != ".md":
                broken.append(f"{target}: an anchor into a file that is not markdown")
            elif frag not in anchors(dest):
                broken.append(f"{target}: no heading #{frag} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)
