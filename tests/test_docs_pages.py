"""The pages a newcomer follows end to end (README.md, docs/pool.md, docs/slurm.md, docs/operations.md) run as
written: each shell block is run (tests/docrun.py ``run_page``: in order, in one bash, in a scratch directory
holding a ``train.py``, as a reader following the page would) or says in its marker why CI does not run it, and
the test lists those as skips with that reason. The adapters' docstrings are run by tests/test_docs_run.py."""

from __future__ import annotations

import os
import re

import pytest
from docrun import REPO, SHELL_LANGS, command_blocks, run_page

pytestmark = pytest.mark.timeout(600)

PAGES = ("README.md", "docs/pool.md", "docs/slurm.md", "docs/operations.md", "docs/transparent.md")
_BLOCKS = [b for page in PAGES for b in command_blocks(os.path.join(REPO, page))]


def test_every_shell_block_of_the_pages_is_run_or_says_why_not():
    """A fence names its language (``text`` for output), so a command cannot hide in an unmarked block; each shell
    block has its docrun marker, and a skip its reason."""
    unnamed = [b.where for b in _BLOCKS if not b.lang]
    assert not unnamed, f"fences without a language (sh for commands, text for output): {unnamed}"
    unmarked = [b.where for b in _BLOCKS if b.lang in SHELL_LANGS and not b.mark]
    assert not unmarked, f"shell blocks with no <!-- docrun: run|skip: WHY --> marker: {unmarked}"
    marked_other = [b.where for b in _BLOCKS if b.mark and b.lang not in SHELL_LANGS]
    assert not marked_other, f"docrun markers on blocks that are not shell: {marked_other}"
    assert {p for p in PAGES if not any(b.page.endswith(p) and b.lang in SHELL_LANGS for b in _BLOCKS)} == set()


@pytest.mark.parametrize("where", [b.where for b in _BLOCKS if b.mark.startswith("skip: ")])
def test_a_block_ci_does_not_run_says_why(where):
    block = next(b for b in _BLOCKS if b.where == where)
    pytest.skip(block.mark[len("skip: "):])


def _page_env(tmp_path) -> dict[str, str]:
    """The reader's shell: tpassrun's venv first on PATH, a scratch directory with `train.py` (a script using the
    worker API: examples/train_ddp.py), no run key or pool key of the caller's."""
    import shutil
    import sys

    shutil.copy(os.path.join(REPO, "examples", "train_ddp.py"), tmp_path / "train.py")
    env = {k: v for k, v in os.environ.items() if k not in ("TPASSRUN_RUN_KEY", "TPASSRUN_POOL_KEY", "SLURM_CONF")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _ports_free(*ports: int) -> bool:
    import socket

    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # a port in TIME_WAIT is free to listen on
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _run(page: str, tmp_path, timeout: float) -> str:
    done = run_page(os.path.join(REPO, page), str(tmp_path), _page_env(tmp_path), timeout)
    assert done.returncode == 0, f"{page}'s run blocks failed ({done.returncode}):\n{done.stdout[-4000:]}"
    return done.stdout


def test_the_pool_page_runs_as_written(tmp_path):
    """docs/pool.md: an etcd, the pool key made and exported, the pool created, its status as JSON, deleted."""
    import shutil

    if shutil.which("etcd") is None or shutil.which("openssl") is None:
        pytest.skip("the page needs etcd and openssl on PATH (scripts/bootstrap.sh installs them)")
    if not _ports_free(23791, 23801):
        pytest.skip("the page's etcd ports 23791/23801 are taken on this machine")
    out = _run("docs/pool.md", tmp_path, 120)
    assert "pool gpu-pool created (key " in out and '"pool": "gpu-pool"' in out and "pool gpu-pool deleted" in out
    key = (tmp_path / "pool.key").read_text().strip()
    assert len(key) == 64 and oct((tmp_path / "pool.key").stat().st_mode & 0o777) == "0o600"


def test_the_slurm_page_runs_as_written(tmp_path):
    """docs/slurm.md: a private Slurm from scratch as root (munged --force on its own socket, AuthInfo=socket=...,
    SlurmUser=root), three idle nodes, a step on them, a drained node handed back by hand (the job's allocation
    shrunk while it runs), then stopped by its pid files."""
    from slurmcluster import unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    if not _ports_free(6917, 6921, 6922, 6923):
        pytest.skip("the page's Slurm ports 6917, 6921-6923 are taken on this machine")
    out = _run("docs/slurm.md", tmp_path, 180)
    assert re.search(r"debug\*\s+up\s+infinite\s+3\s+idle\s+n\[1-3\]", out), out
    assert len([ln for ln in out.splitlines() if ln.strip()]) >= 5       # sinfo's two lines, three hostnames
    # the hand-back by hand: drained and still the job's, then Slurm's again while the job runs on n1, n3
    assert re.search(r"\bdrng\s+n2\b", out) and "State=ALLOCATED+DRAIN" in out, out
    assert re.search(r"\bdrain\s+n2\b", out) and re.search(r"\bR\s+\S+\s+2\s+n\[1,3\]", out), out


@pytest.mark.e2e
def test_the_operations_page_runs_as_written(tmp_path):
    """docs/operations.md's one-machine run: 2 ranks + a warm spare on an etcd of the reader's, rank 1 moved to the
    spare by a taint while it trains, the status and its costs, the summary."""
    import shutil

    if shutil.which("etcd") is None:
        pytest.skip("the page needs etcd on PATH (scripts/bootstrap.sh installs it)")
    if not _ports_free(23793, 23803):
        pytest.skip("the page's etcd ports 23793/23803 are taken on this machine")
    out = _run("docs/operations.md", tmp_path, 400)
    assert "resumed: rank 1 now runs on" in out, out[-3000:]
    assert "costs: time lost to failures" in out and "'known': True" in out, out[-3000:]
    assert re.search(r"summary: 1 swap\(s\) \(pause [\d.]+ m?s\), 0 recover\(ies\)", out), out[-3000:]
    assert re.search(r"summary: time lost to failures [\d.]+ m?s, steps lost 0, steps redone 0, goodput \d+\.\d%",
                     out), out[-3000:]
