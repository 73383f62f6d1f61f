"""Acceptance: the same command lines under real torchrun and under ``python -m tpassrun``.

Each case runs ``python -m torch.distributed.run ARGS`` and ``python -m tpassrun ARGS`` (concurrently,
in separate scratch directories) with ``tests/parity_worker.py``, which dumps its environment and
command line. We compare, after normalising what is random by design (ports, uuid run ids, temp
directory names, MASTER_ADDR, the scratch directory itself):

* the launcher's exit code;
* every worker's full environment (tpassrun's own ``TPASSRUN_*`` variables excepted) and argv, per
  (RANK, attempt);
* the worker lines on the launcher's console (tee prefixes included);
* the log tree under ``attempt_*`` (file names and contents);
* the failure report block (time, host and pids normalised).

``test_torchrun_half`` checks the torchrun side alone against what each case expects, so the harness
is known to be right even while the tpassrun side is not.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "parity_worker.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "tpassrun": [sys.executable, "-m", "tpassrun"],
}
if os.environ.get("PARITY_SELF_CHECK") == "1":
    # Harness check: torchrun against itself must pass every comparison (normalisation is right).
    LAUNCHERS["tpassrun"] = LAUNCHERS["torchrun"]
RUN_TIMEOUT = 60.0
PARALLEL = 4

# Launcher-side knobs that must not leak from the test runner's environment into the cases.
_SCRUB = ("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_", "TPASSRUN_", "PYTEST_", "OMP_NUM_THREADS", "PYTHON_EXEC",
          "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LOGLEVEL")


@dataclasses.dataclass(frozen=True)
class Case:
    """One command line. Placeholders: ``{LOGS}`` a log dir, ``{ROOT}`` the scratch dir (= cwd,
    which holds ``parity_worker.py``), ``{PORT}`` a free port."""

    name: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    rc: int = 0
    dumps: int = 1  # worker dumps the torchrun side produces
    exclusive: bool = False  # torchrun binds a fixed port: never two at once
    exact_master: bool = False  # static backend: MASTER_PORT is the user's, compare it (MASTER_ADDR always is)
    compare_orig_argv: bool = True
    # More agents of the same job, started in order after ``args`` (1 s apart, so join order is defined);
    # the case's rc is every agent's.
    more_agents: tuple[tuple[str, ...], ...] = ()
    stagger: float = 1.0  # seconds between two agents' starts
    run_timeout: float = RUN_TIMEOUT  # workers that import torch take longer on a loaded machine


W = "parity_worker.py"
N2 = ("--nproc-per-node", "2")
CASES = [
    Case("basic", (W,)),
    Case("nnodes_1_nproc2_script_args_look_like_flags",
         ("--nnodes", "1", *N2, W, "a", "--nproc-per-node", "5", "-m", "--standalone", "--", "x"), dumps=2),
    Case("nproc_underscore_omp_inherited", ("--nproc_per_node=2", W), env=(("OMP_NUM_THREADS", "3"),), dumps=2),
    Case("pet_env", (W,), env=(("PET_NPROC_PER_NODE", "2"), ("PET_MAX_RESTARTS", "1"), ("PET_ROLE", "petrole")),
         dumps=2),
    Case("pet_standalone_module", ("parity_worker", "m"), env=(("PET_STANDALONE", "1"), ("PET_MODULE", "1"))),
    Case("module", (*N2, "-m", "parity_worker", "x"), dumps=2),
    Case("no_python", ("--no-python", "./parity_worker.py", "y")),
    # torchrun runs --run-path in a multiprocessing child, tpassrun in `python -c <runpy bootstrap>`.
    Case("run_path", ("--run-path", "{ROOT}/parity_worker.py", "z"), compare_orig_argv=False),
    Case("log_dir_redirect_all", ("--log-dir", "{LOGS}", "-r", "3", *N2, W), dumps=2),
    Case("log_dir_tee_all", ("--log_dir={LOGS}", "-t", "3", *N2, W), dumps=2),
    Case("tee_and_redirect_per_rank_role", ("--log-dir", "{LOGS}", "-t", "0:3,1:1", "-r", "1:2", "--role", "trainer",
                                           *N2, W), dumps=2),
    Case("tee_local_ranks_filter", ("--log-dir", "{LOGS}", "-t", "3", "--local-ranks-filter", "1", *N2, W), dumps=2),
    Case("tee_duplicate_filters", ("--log-dir", "{LOGS}", "-t", "3", "--duplicate-stdout-filters", "rank 1,,x,rank 0",
                                   *N2, W), dumps=2),
    Case("default_tmp_log_dir_redirect", ("-r", "1", W)),
    Case("local_rank_macro", (*N2, W, "--out=${local_rank}.txt", "$$HOME"), dumps=2),
    Case("virtual_local_rank_cuda_devices", ("--virtual-local-rank", *N2, W), env=(("CUDA_VISIBLE_DEVICES", "5,7"),),
         dumps=2),
    Case("role_nccl_async_inherited", ("--role", "trainer", W), env=(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),)),
    Case("standalone_ignores_rdzv_id", ("--standalone", "--rdzv-id", "ignored", W)),
    Case("c10d_endpoint_omitted", ("--rdzv-backend", "c10d", "--rdzv-id", "job1", W), exclusive=True),
    Case("c10d_endpoint_given", ("--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:{PORT}",
                                 "--rdzv-id=100", *N2, W), dumps=2),
    Case("c10d_endpoint_port_0", ("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", W)),
    Case("static_endpoint_omitted", ("--rdzv-backend", "static", "--master-port", "{PORT}", "--nnodes", "1", *N2, W),
         dumps=2, exact_master=True),
    Case("max_restarts_then_fail", ("--max-restarts", "1", *N2, W, "--exit-code", "3", "--exit-rank", "1"),
         rc=1, dumps=4),
    Case("worker_exit_3", (W, "--exit-code", "3", "--exit-rank", "0"), rc=1),
    Case("abbrev_and_accepted_flags", ("--max-re", "2", "--monitor-interval", "0.05", "--start-method", "fork",
                                       "--shutdown-timeout", "5", "--signals-to-handle", "SIGTERM,SIGUSR1", W)),
    Case("unknown_flag", ("--bogus", W), rc=2, dumps=0),
    Case("ambiguous_abbreviation", ("--nproc", "2", W), rc=2, dumps=0),
    # issue 14: the failure report lists the workers the launcher had to stop ("other failures")
    Case("other_failures", ("--nproc-per-node", "3", W, "--exit-code", "3", "--exit-rank", "1", "--linger"),
         rc=1, dumps=3),
    # torchelastic's JSON events on the console (rendezvous, worker start/end, launcher end), success and failure
    Case("event_log_handler_console", ("--event-log-handler", "console", *N2, W), dumps=2),
    Case("event_log_handler_console_failure", ("--event-log-handler=console", "--max-restarts", "1", *N2, W,
                                               "--exit-code", "3", "--exit-rank", "0"), rc=1, dumps=4),
    Case("logs_specs_default", ("--logs-specs=default", *N2, W), dumps=2),
    Case("rdzv_conf_quoted_timeout", ("--rdzv-conf", "timeout=\"5'\"", W)),
    Case("rdzv_conf_quoted_timeout_c10d", ("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:{PORT}",
                                           "--rdzv-conf=timeout='5',join_timeout=60", W)),
    # rejected values: torchrun raises from main (traceback, exit 1); tpassrun says why on one line, exit 1
    Case("unknown_rdzv_backend", ("--rdzv-backend", "nosuch", "--rdzv-endpoint", "localhost:{PORT}", W),
         rc=1, dumps=0),
    Case("unknown_logs_specs", ("--logs-specs", "nosuch", W), rc=1, dumps=0),
    Case("bad_nproc_per_node", ("--nproc-per-node", "lots", W), rc=1, dumps=0),
    Case("nnodes_three_parts", ("--nnodes", "1:2:3", W), rc=1, dumps=0),
    Case("negative_shutdown_timeout", ("--shutdown-timeout", "-1", W), rc=1, dumps=0),
    Case("no_python_with_module", ("--no-python", "-m", W), rc=1, dumps=0),
    Case("max_restarts_not_an_int", ("--max-restarts", "x", W), rc=2, dumps=0),
    # two agents (c10d on a fixed endpoint): roles get their own ROLE_RANK 0..n-1 and ROLE_WORLD_SIZE, and the
    # first agent to join gets the low ranks (its workers' argv tells them apart)
    Case("roles_heterogeneous_two_agents",
         ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{PORT}", "--rdzv-id", "roles",
          "--role", "master", "--nproc-per-node", "1", W, "first"),
         more_agents=(("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{PORT}",
                       "--rdzv-id", "roles", "--role", "trainer", "--nproc-per-node", "2", W, "second"),),
         dumps=3),
    Case("roles_homogeneous_two_agents",
         ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{PORT}", "--rdzv-id", "homo",
          "--role", "trainer", *N2, W, "first"),
         more_agents=(("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{PORT}",
                       "--rdzv-id", "homo", "--role", "trainer", *N2, W, "second"),),
         dumps=4),
    # issue 30: torchrun's file timer (the agent serves FileTimerClient's named pipe; TORCHELASTIC_TIMER_FILE)
    Case("file_timer", (*N2, W, "--file-timer"), env=(("TORCHELASTIC_ENABLE_FILE_TIMER", "1"),), dumps=2,
         run_timeout=240),
    # ...at the path the agent was given
    Case("file_timer_given_path", (W, "--file-timer"), env=(("TORCHELASTIC_ENABLE_FILE_TIMER", "1"),
                                                            ("TORCHELASTIC_TIMER_FILE", "{ROOT}/tmp/my_timer")),
         run_timeout=240),
    # issue 30: c10d's handler never reads "timeout" (join_timeout, 600 s, is its key): a second agent 8 s late
    # still joins
    Case("c10d_conf_timeout_ignored",
         ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{PORT}", "--rdzv-id", "late",
          "--rdzv-conf", "timeout=5", W, "first"),
         more_agents=(("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{PORT}",
                       "--rdzv-id", "late", "--rdzv-conf", "timeout=5", W, "second"),),
         stagger=8.0, dumps=2, run_timeout=240),
    # issue 30: static serves the workers' store on the endpoint (MASTER_ADDR:MASTER_PORT): tcp:// to either works
    Case("static_endpoint_tcp_init", ("--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:{PORT}", *N2, W,
                                      "--tcp-init", "127.0.0.1:{PORT}"), dumps=2, exact_master=True, run_timeout=240),
    Case("static_endpoint_tcp_init_master_env", ("--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:{PORT}",
                                                 "--nnodes", "1", *N2, W, "--tcp-init", "env"),
         dumps=2, exact_master=True, run_timeout=240),
]
if os.environ.get("PARITY_ONLY"):  # development: run only these cases (comma-separated names)
    CASES = [c for c in CASES if c.name in os.environ["PARITY_ONLY"].split(",")]


# ---------------------------------------------------------------- running one side


@dataclasses.dataclass
class SideResult:
    rc: int
    stdout: str
    stderr: str
    dumps: dict[str, list[dict]]  # "RANK/attempt" -> normalised dumps
    log_tree: dict[str, str]  # normalised relative path -> content
    report: str | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_MKDTEMP = "[a-z0-9_]{8}"


def normalise(value: str, root: str) -> str:
    value = value.replace(root, "<ROOT>")
    value = _UUID.sub("<uuid>", value)
    value = re.sub(f"torchelastic_{_MKDTEMP}", "torchelastic_*", value)
    return re.sub(rf"(/[^/]*)_{_MKDTEMP}(?=/attempt_)", r"\1_*", value)  # <run_id>_<rand>


def _normalise_dump(dump: dict, root: str, case: Case, port: str) -> dict:
    env = {k: normalise(v, root) for k, v in dump["env"].items() if not k.startswith("TPASSRUN_")}
    if not case.exact_master:
        env["MASTER_PORT"] = "<port>" if env.get("MASTER_PORT", "").isdigit() else env.get("MASTER_PORT", "")
    elif env.get("MASTER_PORT") == port:
        env["MASTER_PORT"] = "<PORT>"
    # a {PORT} in the script's arguments (the two sides run on different ports)
    out = {"env": env, "argv": [normalise(a, root).replace(port, "<PORT>") for a in dump["argv"]],
           "cwd": normalise(dump["cwd"], root), "write_through": dump["write_through"],
           "all_reduce": dump.get("all_reduce")}
    if case.compare_orig_argv:
        out["orig_argv"] = [normalise(a, root).replace(port, "<PORT>") for a in dump["orig_argv"]]
    return out


def _report_block(stderr: str, root: str) -> str | None:
    """torchrun's ``ChildFailedError`` text, with time/host/pid normalised."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r"=+", line)]
    if len(starts) < 2:
        return None
    block = "\n".join(lines[starts[0]:starts[-1] + 1])
    block = re.sub(r"(time      : ).*", r"\1<time>", block)
    block = re.sub(r"(host      : ).*", r"\1<host>", block)
    block = re.sub(r"pid(:? )\d+", r"pid\1<pid>", block)
    block = re.sub(r"by PID \d+", "by PID <pid>", block)
    return normalise(block, root)


_EVENT_PREFIX = '{"name": "torchelastic.worker.status.'
_VOLATILE_EVENT_FIELDS = ("run_id", "worker_id", "hostname", "duration_ms", "total_run_time")


def _elastic_events(stderr: str) -> list[dict]:
    """--event-log-handler console: torchelastic's JSON events, without what differs by design (ids, pids,
    host, times); ``duration_ms`` is only checked to be set where torchrun sets it."""
    events = []
    for line in stderr.splitlines():
        if line.startswith(_EVENT_PREFIX):
            ev = json.loads(line)
            md = ev["metadata"]
            for k in _VOLATILE_EVENT_FIELDS:
                md[k] = None if md.get(k) is None else "<set>"
            md["raw_error"] = None if md.get("raw_error") is None else "<set>"
            md["metadata"] = re.sub(r'"worker_pid": \[\d+\]', '"worker_pid": [<pid>]', md["metadata"])
            events.append(ev)
    return events


def _console_lines(text: str, marker: str) -> list[str]:
    return sorted(line for line in text.splitlines() if marker in line)


def _log_tree(root: Path) -> dict[str, str]:
    tree = {}
    for path in root.rglob("*"):
        rel = str(path.relative_to(root))
        if path.is_file() and "attempt_" in rel:
            tree[normalise(rel, str(root))] = path.read_text(errors="replace")
    return tree


def _launch(cmd: list[str], env: dict[str, str], cwd: Path,
            timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun forwards it to its workers (they live in their own sessions).
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        err += f"\n<killed after {timeout}s>"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_EXCLUSIVE = threading.Lock()


def _launch_agents(cmds: list[list[str]], env: dict[str, str], cwd: Path, stagger: float = 1.0,
                   timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """Several agents of one job; rc is 0 only if every agent's is, else the first non-zero one."""
    pool = concurrent.futures.ThreadPoolExecutor(len(cmds))
    futures = []
    for i, cmd in enumerate(cmds):
        if i:
            threading.Event().wait(stagger)
        futures.append(pool.submit(_launch, cmd, env, cwd, timeout))
    done = [f.result() for f in futures]
    pool.shutdown()
    rc = next((d.returncode for d in done if d.returncode != 0), 0)
    return subprocess.CompletedProcess(cmds[0], rc, "".join(d.stdout for d in done), "".join(d.stderr for d in done))


def run_side(side: str, case: Case, scratch: Path) -> SideResult:
    root = scratch / case.name / side
    (root / "out").mkdir(parents=True)
    (root / "tmp").mkdir()
    shutil.copy(WORKER, root / "parity_worker.py")
    os.chmod(root / "parity_worker.py", stat.S_IRWXU)
    port = str(_free_port())
    args = [a.replace("{LOGS}", str(root / "logs")).replace("{ROOT}", str(root)).replace("{PORT}", port)
            for a in case.args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB)}
    env.update({k: v.replace("{ROOT}", str(root)) for k, v in case.env}, PARITY_OUT=str(root / "out"),
               TMPDIR=str(root / "tmp"))
    if case.more_agents:
        done = _launch_agents([LAUNCHERS[side] + args] + [LAUNCHERS[side] + [
            a.replace("{LOGS}", str(root / "logs")).replace("{ROOT}", str(root)).replace("{PORT}", port)
            for a in more] for more in case.more_agents], env, root, case.stagger, case.run_timeout)
    elif case.exclusive and LAUNCHERS[side] == LAUNCHERS["torchrun"]:
        with _EXCLUSIVE:
            done = _launch(LAUNCHERS[side] + args, env, root, case.run_timeout)
    else:
        done = _launch(LAUNCHERS[side] + args, env, root, case.run_timeout)
    dumps: dict[str, list[dict]] = {}
    for f in sorted((root / "out").glob("*.json")):
        raw = json.loads(f.read_text())
        key = f"{raw['env'].get('RANK')}/{raw['env'].get('TORCHELASTIC_RESTART_COUNT')}"
        dumps.setdefault(key, []).append(_normalise_dump(raw, str(root), case, port))
    return SideResult(done.returncode, done.stdout, done.stderr, dumps, _log_tree(root), _report_block(done.stderr, str(root)))


@pytest.fixture(scope="module")
def results():
    """Every case on both sides, started at once on a small pool; tests wait for their own case."""
    scratch = Path(tempfile.mkdtemp(prefix="tpassrun-parity-"))
    pool = concurrent.futures.ThreadPoolExecutor(PARALLEL)
    futures = {(c.name, side): pool.submit(run_side, side, c, scratch) for c in CASES for side in LAUNCHERS}
    try:
        yield futures
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _get(results, case: Case, side: str) -> SideResult:
    return results[(case.name, side)].result(timeout=max(RUN_TIMEOUT * 4, case.run_timeout * 2))


def _dump_diff(ours: list[dict], ref: list[dict]) -> str:
    """Only what differs, as {field: (ours, torchrun)}, so a failure names the variable at once."""
    if len(ours) != len(ref):
        return f"{len(ours)} dumps vs {len(ref)}"
    diffs = {}
    for o, r in zip(ours, ref):
        for k in sorted(set(o["env"]) | set(r["env"])):
            if o["env"].get(k) != r["env"].get(k):
                diffs[f"env.{k}"] = (o["env"].get(k), r["env"].get(k))
        for k in sorted((set(o) | set(r)) - {"env"}):
            if o.get(k) != r.get(k):
                diffs[k] = (o.get(k), r.get(k))
    return repr(diffs)


def _why(r: SideResult) -> str:
    return f"rc={r.rc}\n--- stderr (tail) ---\n{r.stderr[-3000:]}"


# ---------------------------------------------------------------- tests


def test_readme_states_the_corpus_real_count():
    if os.environ.get("PARITY_ONLY"):
        pytest.skip("a subset of the corpus")
    readme = (HERE.parent / "README.md").read_text()
    stated = re.search(r"`tests/test_parity.py` runs (\d+) command lines", readme)
    assert stated is not None and int(stated.group(1)) == len(CASES)


def test_corpus_is_big_enough():
    assert len(CASES) >= (1 if os.environ.get("PARITY_ONLY") else 20) and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torchrun_half(results, case):
    """The reference side behaves as the case says (validates the harness itself)."""
    ref = _get(results, case, "torchrun")
    assert ref.rc == case.rc, _why(ref)
    assert sum(len(v) for v in ref.dumps.values()) == case.dumps, _why(ref)
    if case.rc == 1 and case.dumps:
        assert ref.report is not None and "parity_worker.py FAILED" in ref.report


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(results, case):
    ref, ours = _get(results, case, "torchrun"), _get(results, case, "tpassrun")
    assert ours.rc == ref.rc, _why(ours)
    assert sorted(ours.dumps) == sorted(ref.dumps), _why(ours)
    for key in ref.dumps:
        assert ours.dumps[key] == ref.dumps[key], f"RANK/attempt {key}: {_dump_diff(ours.dumps[key], ref.dumps[key])}"
    assert _console_lines(ours.stdout, "hello-out") == _console_lines(ref.stdout, "hello-out")
    assert _console_lines(ours.stderr, "hello-err") == _console_lines(ref.stderr, "hello-err")
    assert _elastic_events(ours.stderr) == _elastic_events(ref.stderr)
    assert ours.log_tree == ref.log_tree
    assert ours.report == ref.report
