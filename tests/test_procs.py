"""Real worker processes: exit codes, signals, log files/tee, teardown ladder, pdeathsig; the failure report."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import uvloop

from tpassrun.launch.config import Std
from tpassrun.launch.procs import CONSOLE, RunLogs, StdioSpec, line_prefix, spawn_worker, stop_workers
from tpassrun.launch.report import (
    ProcessFailure,
    RunOutcome,
    copy_root_cause_error_file,
    exit_code,
    format_failure_report,
)

PY = sys.executable
LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    """Run a coroutine on the stock asyncio loop and on uvloop."""
    return LOOPS[request.param]


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------- exit codes and signals


@pytest.mark.timeout(30)
def test_exit_codes_and_signals(run):
    async def main():
        procs = [
            await spawn_worker(py("pass"), os.environ, CONSOLE, local_rank=0, role="r"),
            await spawn_worker(py("import os; os._exit(3)"), os.environ, CONSOLE, local_rank=1, role="r"),
            await spawn_worker(py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), os.environ, CONSOLE,
                               local_rank=2, role="r"),
        ]
        codes = [await p.wait() for p in procs]
        for p in procs:
            await p.aclose()
        return codes, procs

    codes, procs = run(main())
    assert codes == [0, 3, -signal.SIGKILL]
    assert [p.returncode for p in procs] == codes and all(p.pid > 0 for p in procs)


@pytest.mark.timeout(30)
def test_worker_gets_env_argv_own_session(run, tmp_path):
    out = tmp_path / "o.json"

    async def main():
        code = f"""
            import json, os, sys
            json.dump({{"argv": sys.argv[1:], "x": os.environ.get("X"), "sid": os.getsid(0), "pid": os.getpid(),
                        "pgid": os.getpgid(0)}}, open({str(out)!r}, "w"))
        """
        p = await spawn_worker(py(code) + ["a", "b"], {"X": "1", "PATH": os.environ["PATH"]}, CONSOLE,
                               local_rank=0, role="r")
        assert await p.wait() == 0
        await p.aclose()
        return p.pid

    pid = run(main())
    got = json.loads(out.read_text())
    assert got["argv"] == ["a", "b"] and got["x"] == "1"
    assert got["sid"] == got["pid"] == got["pgid"] == pid  # own session, own process group
    assert os.getsid(0) != pid


def test_spawn_missing_executable_raises(run):
    async def main():
        await spawn_worker(["/nonexistent/bin"], os.environ, CONSOLE, local_rank=0, role="r")

    with pytest.raises(FileNotFoundError):
        run(main())


# ---------------------------------------------------------------- log layout, redirect, tee


def test_run_logs_layout(tmp_path):
    logs = RunLogs(str(tmp_path / "base"), "job", redirects={0: Std.OUT, 1: Std.ERR})
    logs.start_attempt(2)
    s0, s1 = logs.stdio(2, 0), logs.stdio(2, 1)
    run_dir = logs.run_dir
    assert os.path.dirname(run_dir) == str(tmp_path / "base") and os.path.basename(run_dir).startswith("job_")
    assert s0.stdout_path == f"{run_dir}/attempt_2/0/stdout.log" and s0.stderr_path is None
    assert s1.stderr_path == f"{run_dir}/attempt_2/1/stderr.log" and s1.stdout_path is None
    assert s0.error_file == f"{run_dir}/attempt_2/0/error.json" and os.path.isdir(f"{run_dir}/attempt_2/1")
    assert not s0.tee_stdout and s0.prefix == "[default0]:"


def test_run_logs_default_base_is_torchelastic_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    logs = RunLogs(None, "rid")
    assert logs.run_dir.startswith(str(tmp_path / "torchelastic_")) and "/rid_" in logs.run_dir


def test_run_logs_devnull_disables_files():
    logs = RunLogs(os.devnull, "rid", redirects=Std.ALL, tee=Std.ALL)
    logs.start_attempt(0)
    s = logs.stdio(0, 0)
    assert logs.run_dir is None and s.error_file == "" and s.stdout_path is None and s.show_stdout


def test_line_prefix():
    assert line_prefix("trainer", 1, 5, None) == "[trainer1]:"
    assert line_prefix("trainer", 1, 5, "[${role_name} ${rank} ${local_rank}] ") == "[trainer 5 1] "


HELLO = "import sys; print('out line'); print('keep me'); sys.stderr.write('err line\\n')"


@pytest.mark.timeout(30)
def test_redirect_goes_to_files_only(run, tmp_path, capfd):
    logs = RunLogs(str(tmp_path), "rid", redirects=Std.ALL)
    logs.start_attempt(0)
    spec = logs.stdio(0, 0)

    async def main():
        p = await spawn_worker(py(HELLO), os.environ, spec, local_rank=0, role="default")
        assert await p.wait() == 0
        await p.aclose()

    run(main())
    assert open(spec.stdout_path).read() == "out line\nkeep me\n"
    assert open(spec.stderr_path).read() == "err line\n"
    captured = capfd.readouterr()
    assert "out line" not in captured.out and "err line" not in captured.err


@pytest.mark.timeout(30)
def test_tee_writes_files_and_prefixed_console(run, tmp_path):
    logs = RunLogs(str(tmp_path), "rid", tee={0: Std.ALL, 1: Std.OUT}, role="trainer", stdout_filters=("keep",))
    logs.start_attempt(0)
    specs = [logs.stdio(0, r) for r in (0, 1)]
    out, err = io.BytesIO(), io.BytesIO()

    async def main():
        procs = [await spawn_worker(py(HELLO), os.environ, s, local_rank=r, role="trainer", console=(out, err))
                 for r, s in enumerate(specs)]
        assert [await p.wait() for p in procs] == [0, 0]
        for p in procs:
            await p.aclose()

    run(main())
    assert open(specs[0].stdout_path).read() == "out line\nkeep me\n"
    assert open(specs[0].stderr_path).read() == "err line\n" and specs[1].stderr_path is None
    assert sorted(out.getvalue().decode().splitlines()) == [
        "[trainer0]:keep me", "[trainer0]:out line", "[trainer1]:keep me", "[trainer1]:out line"]
    assert err.getvalue().decode() == "[trainer0]:err line\n"
    filtered = open(os.path.join(logs.attempt_dir(0), "filtered_stdout.log")).read()
    assert sorted(filtered.splitlines()) == ["[trainer0]:keep me", "[trainer1]:keep me"]


@pytest.mark.timeout(30)
def test_local_ranks_filter(run, tmp_path, capfd):
    logs = RunLogs(str(tmp_path), "rid", tee={1: Std.ALL}, local_ranks_filter=frozenset({5}))
    logs.start_attempt(0)
    console_only, teed = logs.stdio(0, 0), logs.stdio(0, 1)
    assert not console_only.show_stdout and not teed.tee_stdout and teed.stdout_path
    out, err = io.BytesIO(), io.BytesIO()

    async def main():
        for r, s in enumerate((console_only, teed)):
            p = await spawn_worker(py(HELLO), os.environ, s, local_rank=r, role="default", console=(out, err))
            await p.wait()
            await p.aclose()

    run(main())
    captured = capfd.readouterr()
    assert "out line" not in captured.out + captured.err and out.getvalue() == b"" and err.getvalue() == b""
    assert open(teed.stdout_path).read() == "out line\nkeep me\n"  # files are unaffected by the filter


# ---------------------------------------------------------------- teardown ladder


IGNORE_TERM = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(60)
"""
SLEEPER = """
    import time
    print("ready", flush=True)
    time.sleep(60)
"""
WITH_GRANDCHILD = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    time.sleep(60)
"""


async def spawn_ready(code: str, tmp_path, local_rank: int) -> tuple:
    path = tmp_path / f"out{local_rank}"
    spec = StdioSpec(stdout_path=str(path))
    p = await spawn_worker(py(code), os.environ, spec, local_rank=local_rank, role="r")
    while not path.exists() or not path.read_text().strip():
        await asyncio.sleep(0.01)
    return p, path.read_text().strip()


@pytest.mark.timeout(30)
def test_stop_workers_escalates_to_sigkill(run, tmp_path):
    async def main():
        stubborn, _ = await spawn_ready(IGNORE_TERM, tmp_path, 0)
        polite, _ = await spawn_ready(SLEEPER, tmp_path, 1)
        done = await spawn_worker(py("pass"), os.environ, CONSOLE, local_rank=2, role="r")
        await done.wait()
        return await stop_workers([stubborn, polite, done], grace=0.5, kill_wait=5)

    assert run(main()) == [-signal.SIGKILL, -signal.SIGTERM, 0]


@pytest.mark.timeout(30)
def test_stop_workers_signals_the_whole_group(run, tmp_path):
    """A pytest started in the background by a non-interactive shell (``cmd &``) inherits SIGINT ignored, and so
    would its workers (an ignored signal stays ignored across exec, as under torchrun): two whole-suite runs
    started so saw the worker ignore SIGINT (-9 after the grace). The test gives its workers what a foreground
    launch gives them: SIGINT handled here while they start (a handled signal is default again after exec)."""
    async def main():
        p, grandchild = await spawn_ready(WITH_GRANDCHILD, tmp_path, 0)
        codes = await stop_workers([p], sig=signal.SIGINT, grace=5)
        return codes, int(grandchild)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        codes, grandchild = run(main())
    finally:
        signal.signal(signal.SIGINT, before)
    # Python turns SIGINT into KeyboardInterrupt, then dies of SIGINT; the grandchild got it too.
    assert codes == [-signal.SIGINT]
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(grandchild)


def test_stop_workers_with_nothing_running(run):
    assert run(stop_workers([], grace=1)) == []


# ---------------------------------------------------------------- pdeathsig


FAKE_AGENT = """
    import asyncio, os, sys
    from tpassrun.launch.procs import CONSOLE, spawn_worker

    async def main():
        w = await spawn_worker([sys.executable, "-c", "import time; time.sleep(60)"], os.environ, CONSOLE,
                               local_rank=0, role="r")
        print(w.pid, flush=True)
        await w.wait()

    {runner}(main())
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("runner", ["asyncio.run", "__import__('uvloop').run"])
def test_sigkilled_agent_leaves_no_orphan(runner):
    agent = subprocess.Popen(py(FAKE_AGENT.format(runner=runner)), stdout=subprocess.PIPE, text=True)
    try:
        worker = int(agent.stdout.readline())
        assert alive(worker)
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(worker)
    finally:
        agent.kill()
        agent.wait()
        agent.stdout.close()


# ---------------------------------------------------------------- failure report


def record_error_file(path, message="ValueError: boom", timestamp=1700000000):
    data = {"message": {"message": message, "extraInfo": {"py_callstack": "Traceback:\n  line 1\nValueError: boom",
                                                         "timestamp": str(timestamp)}}}
    path.write_text(json.dumps(data))
    return str(path)


def test_process_failure_messages(tmp_path):
    sig = ProcessFailure.from_exit(local_rank=0, rank=2, pid=77, exitcode=-15, error_file=str(tmp_path / "none"),
                                   now=lambda: 5.0)
    assert sig.message == "Signal 15 (SIGTERM) received by PID 77" and sig.error_file == "<N/A>"
    assert sig.timestamp == 5 and sig.signal_name() == "SIGTERM"
    plain = ProcessFailure.from_exit(local_rank=0, rank=2, pid=77, exitcode=3, error_file="", now=lambda: 5.0)
    assert plain.message.startswith("To enable traceback") and plain.signal_name() == "<N/A>"
    rec = ProcessFailure.from_exit(local_rank=1, rank=3, pid=78, exitcode=1,
                                   error_file=record_error_file(tmp_path / "e.json"))
    assert rec.timestamp == 1700000000 and rec.message["message"] == "ValueError: boom"


@pytest.mark.timeout(60)
def test_report_is_identical_to_torchruns(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchFailure

    err = record_error_file(tmp_path / "e.json", timestamp=int(time.time()) - 100)
    cases = [
        [(0, 0, 101, -15, str(tmp_path / "missing"))],
        [(0, 0, 101, -15, str(tmp_path / "missing")), (1, 1, 102, 1, err)],
        [(0, 4, 103, 3, ""), (1, 5, 104, -9, "")],
    ]
    for case in cases:
        ours = [ProcessFailure.from_exit(local_rank=lr, rank=r, pid=pid, exitcode=code, error_file=ef)
                for lr, r, pid, code, ef in case]
        theirs = {r: TorchFailure(local_rank=lr, pid=pid, exitcode=code, error_file=ef) for lr, r, pid, code, ef in case}
        for t, o in zip(theirs.values(), ours):  # pin the "now" timestamps torchrun would have taken
            t.timestamp = o.timestamp
        assert format_failure_report("train.py", ours) == ChildFailedError("train.py", theirs).format_msg()


def test_copy_root_cause_error_file(tmp_path):
    early = ProcessFailure.from_exit(local_rank=1, rank=1, pid=9, exitcode=-11,
                                     error_file=record_error_file(tmp_path / "e1.json", timestamp=10))
    late = ProcessFailure.from_exit(local_rank=0, rank=0, pid=8, exitcode=-15, error_file="", now=lambda: 99.0)
    target = tmp_path / "parent.json"
    target.write_text("old")
    assert copy_root_cause_error_file([late, early], {"TORCHELASTIC_ERROR_FILE": str(target)}) == str(target)
    data = json.loads(target.read_text())
    assert data["message"]["errorCode"] == -11 and data["message"]["message"] == "ValueError: boom"
    assert copy_root_cause_error_file([late, early], {}) is None
    assert copy_root_cause_error_file([late], {"TORCHELASTIC_ERROR_FILE": str(target)}) is None


def test_exit_codes_follow_torchrun():
    assert exit_code(RunOutcome.SUCCEEDED) == 0
    assert {exit_code(o) for o in RunOutcome if o is not RunOutcome.SUCCEEDED} == {1}


@pytest.mark.parametrize("content", ['{"message": {"message": "Bo', "", "[1, 2]", '{"message": 5}', '{"x": 1}',
                                     '{"message": {"extraInfo": {}}}'])
def test_torn_or_foreign_error_file_is_reported_without_it(tmp_path, content):
    """issue 11: a worker killed mid-write leaves a torn error.json; the failure is still reported (torchrun 2.13
    raises here and its agent dies with a traceback, never using --max-restarts)."""
    torn = tmp_path / "error.json"
    torn.write_text(content)
    f = ProcessFailure.from_exit(local_rank=1, rank=3, pid=9, exitcode=3, error_file=str(torn), now=lambda: 7.0)
    assert (f.error_file, f.timestamp, f.rank) == ("<N/A>", 7, 3)
    assert "FAILED" in format_failure_report("train.py", [f])
    target = tmp_path / "parent.json"
    bogus = dataclasses.replace(f, error_file=str(torn))  # as if it had been read: the copy must not crash either
    copied = copy_root_cause_error_file([bogus], {"TORCHELASTIC_ERROR_FILE": str(target)})
    assert copied == (str(target) if content.startswith("{\"") and content.endswith("}") else None)


@pytest.mark.timeout(240)
def test_torn_error_file_still_uses_max_restarts(tmp_path):
    """End to end: every attempt's worker writes a torn error.json and exits 3; the agent restarts it once
    (--max-restarts 1), then prints torchrun's failure report and exits 1."""
    script = tmp_path / "torn.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        p = os.environ["TORCHELASTIC_ERROR_FILE"]
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write('{"message": {"message": "Bo')
        print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
        sys.exit(3)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TPASSRUN_"))}
    done = subprocess.run([PY, "-m", "tpassrun", "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
                           str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "attempt 0" in done.stdout and "attempt 1" in done.stdout, done.stdout
    assert "torn.py FAILED" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


# ---------------------------------------------------------------- a finished worker's own children

FORKING_SCRIPT = """
import os, sys, time
pid = os.fork()
if pid == 0:            # a helper the script forked (in the worker's session), never waited for
    time.sleep(600)
    os._exit(0)
with open(sys.argv[1], "w") as fh:
    fh.write(str(pid))
"""


@pytest.mark.timeout(120)
def test_helpers_of_a_finished_worker_end_with_the_job(tmp_path):
    """The worker exits 0 leaving a child it forked: the job ends (exit 0) and takes that child with it."""
    script, pidfile = tmp_path / "forks.py", tmp_path / "helper.pid"
    script.write_text(FORKING_SCRIPT)
    agent = subprocess.run([sys.executable, "-m", "tpassrun", "--standalone", "--nproc-per-node", "1",
                            "--log-dir", str(tmp_path / "logs"), str(script), str(pidfile)],
                           capture_output=True, text=True, timeout=100)
    helper = int(pidfile.read_text())
    try:
        assert agent.returncode == 0, agent.stderr[-2000:]
        deadline = time.monotonic() + 10     # bounded wait for the kernel to finish the kill, not a timing claim
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(helper), "a process the finished worker forked outlived the job"
    finally:
        if alive(helper):
            os.kill(helper, signal.SIGKILL)
