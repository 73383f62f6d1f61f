"""The console scripts as users run them: ``tpassrun`` and ``tpassctl`` from the environment's ``bin/``, in a
working directory outside the source tree, with no ``PYTHONPATH``, so only the installed package is importable
(``tpassrun``, ``tpassrun.rendezvous``, ``tpassrun.health``; never the repository's top-level ``health/`` or
``rendezvous/``). The suite's other jobs run the same way (``faults.Job`` starts them in their output directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from faults import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent

TINY = """\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
os.write(1, f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():g}\\n".encode())  # one write: ranks share stdout
dist.destroy_process_group()
"""


def _run(tool: str, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool
    if not exe.exists():
        pytest.skip(f"no {tool} console script in {BIN}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working directory outside the source tree, where ``import health`` finds nothing of this project."""
    assert not str(tmp_path.resolve()).startswith(str(Path(REPO).resolve()) + os.sep)
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            "print(u.find_spec('health') is None and u.find_spec('rendezvous') is None)"],
                           cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "True":
        pytest.skip(f"a top-level health/rendezvous is importable outside the tree: {probe.stdout}{probe.stderr}")
    return tmp_path


def _one_line_error(r: subprocess.CompletedProcess[str], starts: str) -> None:
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(starts) and r.stderr.count("\n") == 1, r.stderr


def test_help_of_both_console_scripts(outside):
    for tool in ("tpassrun", "tpassctl"):
        r = _run(tool, "--help", cwd=outside)
        assert r.returncode == 0 and "usage:" in r.stdout and "Traceback" not in r.stderr, (tool, r.stderr)


def test_invalid_or_missing_health_config_is_one_line(outside):
    """Installed, ``--health-config`` with any path ended in ``ModuleNotFoundError: No module named 'health'``."""
    bad = outside / "bad.toml"
    bad.write_text("rules = [ {")
    for path in (bad, outside / "missing.toml"):
        _one_line_error(_run("tpassrun", "--standalone", "--health-config", str(path), "t.py", cwd=outside),
                        "tpassrun: error: --health-config")


def test_two_ranks_with_a_valid_health_config(outside):
    """A 2-rank run of a tiny script, installed, from a foreign cwd, with a valid ``--health-config``."""
    policy = outside / "policy.json"
    policy.write_text(json.dumps({"v": 1, "extends_default": True, "rules": [
        {"metric": "temperature_c", "op": ">=", "threshold": 95, "window": 5, "effect": "exclude",
         "clear_after": None, "name": "temperature"}]}))
    (outside / "tiny.py").write_text(TINY)
    r = _run("tpassrun", "--standalone", "--nproc-per-node", "2", "--health-config", str(policy),
             "--log-dir", str(outside / "logs"), "tiny.py", cwd=outside)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("rank ")) == \
        ["rank 0 of 2: 3", "rank 1 of 2: 3"], r.stdout
