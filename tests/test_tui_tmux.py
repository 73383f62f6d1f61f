"""The real ``tpassctl status --watch`` in a real terminal (tmux), against a real etcd: what a person sees is
the pure frame of the same document, keys page and filter it, and the watch exits with the run's outcome."""

from __future__ import annotations

import asyncio
import io
import json
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from faults import faults_env, hold_at

from tpassrun.ops.ctl import main as ctl_main
from tpassrun.ops.tui import ViewState
from tpassrun.rendezvous import EtcdConfig, EtcdStore, RendezvousSettings

sys.path.insert(0, str(Path(__file__).parent))
from test_tui import eventful_run, frame

FUTURE = 1e11
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def _put_run(endpoint: str, run_id: str, doc: dict) -> None:
    """The run's keys as its agents would leave them (generation, status, health, taints)."""
    async def put() -> None:
        prefix = RendezvousSettings.from_conf(run_id, 1, 1, {}).run_prefix
        async with EtcdStore(EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})) as store:
            if doc.get("generation"):
                await store.put_json(prefix + "generation", doc["generation"])
            if doc.get("closed"):
                await store.put_json(prefix + "closed", doc["closed"])
            for kind in ("status", "health", "taints"):
                for name, value in (doc.get(kind) or {}).items():
                    record = {**value, "v": 1} if kind == "taints" else {**value, "v": 1, "node_id": name}
                    if kind == "status":
                        record["time"] = FUTURE   # ages show as 0.0s whatever the clock: exact frames
                    await store.put_json(prefix + f"{kind}/{name}", record)   # valid records (tpassrun/records/__init__.py)
    asyncio.run(put())


def _capture(session: str) -> str:
    out = subprocess.run(["tmux", "capture-pane", "-t", session, "-p"], check=True, capture_output=True,
                         text=True).stdout
    return "\n".join(line.rstrip() for line in out.splitlines()).strip("\n") + "\n"


def _wait_for_screen(session: str, expected: str, timeout: float = 60.0) -> None:
    """The pane shows exactly ``expected`` (a capture can land in the middle of a redraw: poll)."""
    deadline = time.monotonic() + timeout
    while True:
        screen = _capture(session)
        if screen == expected or time.monotonic() > deadline:
            assert screen == expected
            return
        time.sleep(0.1)


def _wait_for(session: str, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = _capture(session)
        if text in screen or time.monotonic() > deadline:
            assert text in screen, f"{text!r} never appeared; screen:\n{screen}"
            return screen
        time.sleep(0.1)


@pytest.mark.timeout(90)
def test_watch_in_tmux_pages_filters_and_exits_with_the_outcome(etcd_server, run_id, tmp_path):
    doc = eventful_run(64)
    doc.pop("swaps")                                          # no wall-clock ages on screen: frames are exact
    _put_run(etcd_server.endpoint, run_id, doc)
    # What the frame must be: the pure render of what `tpassctl status --json` reads back.
    buf = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, buf
    try:
        assert ctl_main(["status", "--json", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id]) == 0
    finally:
        sys.stdout = sys_stdout
    read_back = json.loads(buf.getvalue())

    session = f"tpw-{uuid.uuid4().hex[:8]}"
    rc_file = tmp_path / "rc"
    cmd = (f"{sys.executable} -m tpassrun.ops.ctl status --watch --interval 0.2 --rdzv-endpoint {etcd_server.endpoint}"
           f" --rdzv-id {run_id}; echo $? > {rc_file}; sleep 30")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd], check=True)
    try:
        _wait_for(session, "page 1/")
        first = frame(read_back, now=time.time())
        _wait_for_screen(session, first)
        assert len(first.splitlines()) == 24 and "nodes 1-18 of 64" in first

        subprocess.run(["tmux", "send-keys", "-t", session, "n"], check=True)
        _wait_for_screen(session, frame(read_back, now=time.time(), view=ViewState(page=1)))
        subprocess.run(["tmux", "send-keys", "-t", session, "p"], check=True)
        _wait_for(session, "page 1/")
        subprocess.run(["tmux", "send-keys", "-t", session, "/", "-", "0", "6", "Enter"], check=True)
        _wait_for_screen(session, frame(read_back, now=time.time(), view=ViewState(node_filter="-06")))

        _put_run(etcd_server.endpoint, run_id, {"closed": {"v": 1, "reason": "workers failed: rank 3 exited 1"}})
        deadline = time.monotonic() + 15
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rc_file.read_text().strip() == "1"
        assert "run " + run_id + " ended: workers failed: rank 3 exited 1" in _capture(session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


@pytest.mark.timeout(60)
def test_watch_in_tmux_quits_on_q(etcd_server, run_id, tmp_path):
    doc = eventful_run(2)
    doc.pop("swaps")
    _put_run(etcd_server.endpoint, run_id, doc)
    session = f"tpw-{uuid.uuid4().hex[:8]}"
    rc_file = tmp_path / "rc"
    cmd = (f"{sys.executable} -m tpassrun.ops.ctl status --watch --rdzv-endpoint {etcd_server.endpoint}"
           f" --rdzv-id {run_id}; echo $? > {rc_file}; sleep 30")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd], check=True)
    try:
        _wait_for(session, "page 1/1")
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 15
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rc_file.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


@pytest.mark.timeout(300)
def test_tpassrun_tui_draws_the_panel_under_the_workers_output(tmp_path):
    """``tpassrun --tui`` in a real terminal: the workers' lines scroll above, the status panel stays in the
    bottom lines, and at exit the panel is wiped and the terminal given back."""
    from tpassrun.ops.tui_panel import panel_height

    root = Path(__file__).parent.parent
    session = f"tpr-{uuid.uuid4().hex[:8]}"
    rc_file = tmp_path / "rc"
    # the job waits at step 100 until the panel was seen (150 quick steps can end before its first frame)
    hold = hold_at(tmp_path, 100)
    faults = shlex.quote(faults_env(hold.fault)["TPASSRUN_FAULTS"])
    cmd = (f"cd {root} && TPASSRUN_FAULTS={faults} {sys.executable} -m tpassrun --tui --standalone "
           f"--nproc-per-node 1 --log-dir {tmp_path}/logs examples/train_ddp.py --steps 150; echo $? > {rc_file}; "
           "sleep 60")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "30", cmd], check=True)
    try:
        deadline = time.monotonic() + 100
        while True:
            lines = subprocess.run(["tmux", "capture-pane", "-t", session, "-p"], check=True, capture_output=True,
                                   text=True).stdout.splitlines()
            panel = lines[30 - panel_height(30):]
            above = lines[:30 - panel_height(30)]
            if any(line.startswith("step 50 loss") for line in above) and panel and \
                    panel[0].startswith("gen 0 active"):
                break
            assert time.monotonic() < deadline and not rc_file.exists(), "\n".join(lines)
            time.sleep(0.2)
        assert panel[1].startswith("run ") and any(line.startswith("NODE") for line in panel)
        assert any(line.split()[:3][1:] == ["member", "0"] for line in panel if line.strip()), panel
        hold.release()
        deadline = time.monotonic() + 120
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rc_file.read_text().strip() == "0"
        final = subprocess.run(["tmux", "capture-pane", "-t", session, "-p"], check=True, capture_output=True,
                               text=True).stdout
        assert "done: 150 steps" in final and "NODE" not in final   # the panel is gone with the run
    finally:
        hold.release()
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
