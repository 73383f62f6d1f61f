"""A spare of a script that never imports tpassrun parks instead of failing on RANK=-1; everything else about
how the script runs (argv, __main__, sys.path[0], -m) is what plain ``python -u`` gives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)

PLAIN = """
import os, sys
print("main", __name__, sys.argv[1:], os.path.realpath(sys.path[0]) == os.path.realpath(os.path.dirname(__file__)),
      flush=True)
import torch.distributed as dist
dist.init_process_group("gloo")
print("joined", dist.get_rank(), flush=True)
"""


def _env(tmp_path, spare: bool) -> dict[str, str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "-1" if spare else "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.pop("TPASSRUN_SPARE", None)
    if spare:
        env["TPASSRUN_SPARE"] = "1"
    return env


def test_a_plain_script_parks_in_a_spare_until_stopped(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "tpassrun.launch.sparestart", str(script), "a", "--b"],
                            env=_env(tmp_path, spare=True), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(tmp_path.parent))
    try:
        assert proc.stdout.readline().split() == ["main", "__main__", "['a',", "'--b']", "True"]
        time.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read()     # parked, not crashed on RANK=-1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert "joined" not in out and "Traceback" not in err


def test_without_the_spare_flag_the_guard_passes_init_through(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = {**_env(tmp_path, spare=False), "MASTER_PORT": str(port)}
    out = subprocess.run([sys.executable, "-u", "-m", "tpassrun.launch.sparestart", str(script)], env=env,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "joined 0"


def test_module_targets_run_as_python_dash_m(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import sys; print(__name__, sys.argv[1:], sys.argv[0].endswith('mod.py'))")
    out = subprocess.run([sys.executable, "-u", "-m", "tpassrun.launch.sparestart", "-m", "pkg.mod", "x"], cwd=str(tmp_path),
                         env=_env(tmp_path, spare=True), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "__main__ ['x'] True"
