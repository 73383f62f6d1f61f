"""The run registry and tpassctl without ids: a running --standalone job is found by ``tpassctl status``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from faults import Job

from tpassrun.ops import registry
from tpassrun.ops.registry import RegistryError, RunEntry, list_runs, register, registry_dir, unregister

pytestmark = pytest.mark.timeout(240)


def test_entries_are_private_and_dead_launchers_are_pruned(tmp_path):
    d = registry_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert d == str(tmp_path / "tpassrun") and os.stat(d).st_mode & 0o777 == 0o700
    live = register(RunEntry(run_id="a/b", endpoint="127.0.0.1:1", pid=os.getpid(), credentials="/x/creds"), d)
    assert os.stat(live).st_mode & 0o777 == 0o600 and "/" not in os.path.basename(live)[:-5]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = register(RunEntry(run_id="old", endpoint="127.0.0.1:2", pid=dead.pid), d)
    runs = list_runs(d)
    assert [r.run_id for r in runs] == ["a/b"] and runs[0].credentials == "/x/creds"
    assert not os.path.exists(stale)
    doc = json.load(open(live))
    assert "password" not in json.dumps(doc)
    unregister(live)
    assert list_runs(d) == []


def test_a_directory_others_can_write_is_refused(tmp_path):
    os.makedirs(tmp_path / "tpassrun", mode=0o777)
    os.chmod(tmp_path / "tpassrun", 0o777)
    with pytest.raises(RegistryError):
        registry_dir({"XDG_RUNTIME_DIR": str(tmp_path)})


def _ctl(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpassrun.ops.ctl", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


@pytest.mark.e2e
def test_tpassctl_finds_a_standalone_job_without_ids(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    os.makedirs(env["XDG_RUNTIME_DIR"], mode=0o700)
    assert "no tpassrun runs on this machine" in _ctl("status", env=env).stderr
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=None, run_id="", nproc=2, spares=1, steps=100000,
                       step_sleep=0.05, env=env).start()
    try:
        job.wait_step(2, 180)
        log = job.log()
        assert " at etcd 127.0.0.1:" in log and "event log " in log      # printed at start
        st = _ctl("status", "--json", env=env)
        assert st.returncode == 0, st.stderr
        snap = json.loads(st.stdout)
        # named on the command line (as the demo does), its etcd's per-run credentials still come from the registry
        run = registry.list_runs(os.path.join(env["XDG_RUNTIME_DIR"], "tpassrun"))[0]
        named = _ctl("status", "--json", "--rdzv-endpoint", run.endpoint, "--rdzv-id", run.run_id, env=env)
        assert named.returncode == 0 and json.loads(named.stdout)["run_id"] == run.run_id, named.stderr
        node = next(iter(snap["status"]))
        host = node.rsplit("-", 2)[0]
        tainted = _ctl("taint", "--node", host, "--local-rank", "1", "--reason", "by hostname", env=env)
        assert tainted.returncode == 0 and f"node {node} local rank 1" in tainted.stdout, tainted
        # it waited (like kubectl drain), printing the phases, until training resumed on the spare
        assert ": pause" in tainted.stdout and "transfer (boundary took" in tainted.stdout, tainted.stdout
        assert tainted.stdout.rstrip().splitlines()[-1].startswith("resumed: rank 1 now runs on "), tainted.stdout
        queued = _ctl("taint", "--rank", "0", "--reason", "no spare left", env=env)        # the spare is used
        assert queued.returncode == 0 and "queued for lack of a spare" in queued.stdout, queued
        deadline = time.monotonic() + 120
        while "swap_resumed" not in [e["event"] for e in job.events()]:
            assert time.monotonic() < deadline and job.proc.poll() is None, job.log()[-3000:]
            time.sleep(0.2)
        ev = _ctl("events", env=env)
        assert ev.returncode == 0 and "taint received: rank 1 on " in ev.stdout and "by hostname" in ev.stdout and "swapped and resumed" in ev.stdout, ev
        raw = _ctl("events", "--json", env=env).stdout.splitlines()
        assert json.loads(raw[0])["event"] == "agent_started"
    finally:
        job.kill()
    assert registry.list_runs(os.path.join(env["XDG_RUNTIME_DIR"], "tpassrun")) == []   # pruned: launcher gone
    assert "no tpassrun runs on this machine" in _ctl("status", env=env).stderr


def test_tpassctl_events_prints_console_lines_and_follow_stops_with_the_launcher(tmp_path):
    import io

    from tpassrun.ops.ctl_events import print_events

    log = tmp_path / "events.jsonl"
    log.write_text(json.dumps({"event": "generation_joined", "time": 1.0, "mono": 1.0, "node": "h-1-ab",
                               "generation": 0, "world_size": 2, "members": ["h-1-ab"]}) + "\n"
                   + '{"event": "torn')
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    out = io.StringIO()
    entry = RunEntry(run_id="r", endpoint="e", pid=done.pid, event_log=str(log))
    assert print_events(entry, follow=True, raw=False, out=out) == 0          # the launcher is gone: returns
    assert out.getvalue().count("\n") == 1 and "[node h] generation 0 formed: world size 2" in out.getvalue()


def test_several_runs_are_listed_with_their_script_and_start_time(tmp_path):
    """With several runs on a machine, `tpassctl status` listed bare UUIDs: it now says what each runs and when
    it started."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    d = registry_dir(env)
    for i in range(2):
        register(RunEntry(run_id=f"run-{i}", endpoint=f"127.0.0.1:{i + 1}", pid=os.getpid(), nproc=2, spares=1,
                          script=f"train.py --steps {100 * (i + 1)}", started=time.time() - 90), d)
    out = _ctl("status", env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "2 runs on this machine (pick one with --rdzv-id):"
    assert lines[1].startswith("  run-0  started ") and "(up 1m3" in lines[1]        # two lines a run (80 columns)
    assert "train.py --steps 100  2+1 slots" in lines[2] and lines[3].startswith("  run-1  started ")
    assert "train.py --steps 200" in lines[4]


def test_the_script_shown_is_the_entry_points_name_and_arguments_cut_to_fit():
    from tpassrun.settings import LaunchConfig

    cfg = LaunchConfig(training_script="/home/me/proj/train.py", training_script_args=("--steps", "200"))
    assert registry._script_of(cfg) == "train.py --steps 200"
    long = LaunchConfig(training_script="t.py", training_script_args=tuple(["--flag"] * 20))
    assert len(registry._script_of(long)) == 48 and registry._script_of(long).endswith("...")
