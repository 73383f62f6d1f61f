"""Run the GPU checks (``checks.CHECKS``), each in a process of its own, and print one table.

    python scripts/gpucheck/harness.py [--dry-run] [--only NAME,...] [--budget S] [--keep]

Every check runs as ``harness.py --run-check NAME`` in a session of its own, with a hard timeout (its own,
capped by what is left of ``--budget``): past it the session gets SIGTERM, then SIGKILL, and every process
group the check recorded (its jobs and etcd, which run in sessions of their own) is killed too. A check
that raised, timed out or died still gets its row: the first line of its error, or its last progress line.
The last rows are the harness's own: a hung check is stopped at its timeout with what it started, and no
process started by any check is left running. Exit code 0 when no row failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
GRACE_S = 5.0            # between SIGTERM and SIGKILL of a check that ran out of time


@dataclass
class Row:
    check: str
    result: str
    figure: str = ""
    where: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return not (self.result == "ok" or self.result.startswith("skipped"))


# --------------------------------------------------------------------------------------------- one check (child)


def run_one(name: str, workdir: str, dry_run: bool, gpus: int, rehearse: bool = False) -> int:
    """In the check's own process: run it, write its row to ``result.json``."""
    sys.path.insert(0, HERE)
    from support import Ctx, Failed, Skip

    directory = os.path.join(workdir, slug(name))
    ctx = Ctx(name=name, dir=directory, dry_run=dry_run, gpus=gpus, rehearse=rehearse)
    if name == HANG:
        return _hang(ctx)
    from checks import CHECKS

    signal.signal(signal.SIGTERM, _exit_on_signal)      # out of time: every finally runs (jobs are killed)
    started = time.monotonic()
    try:
        result, figure = CHECKS[name][0](ctx)
        row = Row(name, result, figure)
    except Skip as exc:
        row = Row(name, f"skipped: {exc}")
    except Failed as exc:
        row = Row(name, "FAIL", where=first_line(str(exc)))
    except BaseException as exc:  # noqa: BLE001 - every error becomes the row's "where it failed"
        traceback.print_exc()
        row = Row(name, "FAIL", where=first_line(f"{type(exc).__name__}: {exc}") + _frame(exc))
    row.seconds = time.monotonic() - started
    with open(os.path.join(directory, "result.json"), "w") as fh:
        json.dump(row.__dict__, fh)
    return 0


def _frame(exc: BaseException) -> str:
    """Where in the check's code it was raised (file:line), so the row alone says where to look."""
    tb = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in tb if f.filename.startswith(HERE)] or tb
    return f" ({os.path.basename(ours[-1].filename)}:{ours[-1].lineno})" if ours else ""


def _exit_on_signal(signum: int, _frame: object) -> None:
    signal.signal(signum, signal.SIG_DFL)
    raise SystemExit(f"stopped by signal {signum}: out of time")


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")[:240]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


HANG = "harness: hung check stopped"


def _hang(ctx) -> int:
    """The harness's self-test: a check that starts a process in a session of its own and never returns."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    ctx.started(child.pid)
    with open(os.path.join(ctx.dir, "grandchild"), "w") as fh:
        fh.write(str(child.pid))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)         # deaf to SIGTERM: only SIGKILL stops it
    ctx.say("hanging")
    time.sleep(600)
    return 0


# --------------------------------------------------------------------------------------------- the harness


def launch(name: str, workdir: str, dry_run: bool, gpus: int, rehearse: bool = False) -> tuple[subprocess.Popen, str]:
    directory = os.path.join(workdir, slug(name))
    os.makedirs(directory, exist_ok=True)
    log = open(os.path.join(directory, "log.txt"), "w")
    argv = [sys.executable, os.path.abspath(__file__), "--run-check", name, "--workdir", workdir,
            "--gpus", str(gpus), *(["--dry-run"] if dry_run else []), *(["--rehearse"] if rehearse else [])]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, directory


def collect(name: str, proc: subprocess.Popen, directory: str, timeout: float, started: float,
            grace: float = GRACE_S) -> Row:
    """Wait for the check (until ``started + timeout``), stop it and everything it started, read its row."""
    timed_out = False
    try:
        proc.wait(max(0.0, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
    _signal_group(proc.pid, signal.SIGKILL)              # whatever it left in its own group
    for pid in recorded(directory):
        _signal_group(pid, signal.SIGKILL)
    elapsed = time.monotonic() - started
    result = os.path.join(directory, "result.json")
    if os.path.exists(result) and not timed_out:
        with open(result) as fh:
            return Row(**{**json.load(fh), "seconds": elapsed})
    last = last_progress(os.path.join(directory, "log.txt"))
    if timed_out:
        return Row(name, "FAIL", where=f"timed out after {timeout:.0f}s; last: {last}", seconds=elapsed)
    return Row(name, "FAIL", where=f"the check process died (exit {proc.returncode}); last: {last}", seconds=elapsed)


def recorded(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "pids")) as fh:
            return [int(line) for line in fh if line.strip()]
    except OSError:
        return []


def last_progress(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as fh:
            lines = [line.strip() for line in fh if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:200] if lines else "(empty log)"


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def alive_groups(pids: list[int]) -> list[int]:
    """Which of these process groups still have a member (a zombie leader alone does not count)."""
    left = []
    for pgid in pids:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                left.append(pgid)
                break
    return left


def gone(pgids: list[int], timeout: float = 10.0) -> list[int]:
    """The groups still alive once ``timeout`` has passed (a SIGKILLed process takes a moment to go)."""
    deadline = time.monotonic() + timeout
    while (left := alive_groups(pgids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def hang_row(workdir: str, dry_run: bool) -> Row:
    """Start the self-test check with a 2 s timeout: the harness must stop it and its grandchild."""
    started = time.monotonic()
    proc, directory = launch(HANG, workdir, dry_run, 0)
    until = time.monotonic() + 30
    while not os.path.exists(os.path.join(directory, "grandchild")) and time.monotonic() < until:
        time.sleep(0.05)
    row = collect(HANG, proc, directory, 2.0 + (time.monotonic() - started), started, grace=1.0)
    left = gone([proc.pid, *recorded(directory)])
    if not row.where.startswith("timed out") or left:
        return Row(HANG, "FAIL", where=f"expected a timeout and nothing left; got {row.where!r}, left {left}",
                   seconds=row.seconds)
    return Row(HANG, "ok", f"a check deaf to SIGTERM and its own session's child: both gone "
                           f"after its 2 s timeout ({row.seconds:.1f} s)", seconds=row.seconds)


def table(rows: list[Row]) -> str:
    head = ("check", "result", "figure", "where it failed")
    cells = [head] + [(r.check, r.result, r.figure, r.where) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = []
    for i, c in enumerate(cells):
        lines.append(" | ".join(c[k].ljust(widths[k]) for k in range(3)) + " | " + c[3])
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * len(head[3]))
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the GPU check: each check in its own process, one table")
    p.add_argument("--dry-run", action="store_true", help="on CPU: every GPU check says 'skipped: no GPU'")
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for all checks together")
    p.add_argument("--keep", action="store_true", help="keep the work directory even when every check passed")
    p.add_argument("--workdir", default=None)
    p.add_argument("--run-check", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    # the job checks with --device cpu, to rehearse the harness on a machine without a GPU (GPUCHECK_STEP_S and
    # --timeout-scale stretch the waits on a loaded host)
    p.add_argument("--rehearse", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout-scale", type=float, default=1.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_check:
        return run_one(args.run_check, args.workdir, args.dry_run, args.gpus, args.rehearse)

    sys.path.insert(0, HERE)
    from checks import CHECKS

    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu_check: error: unknown check(s) {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    names = ["environment"] + [n for n in names if n != "environment"]    # it tells the others the GPUs
    workdir = args.workdir or tempfile.mkdtemp(prefix="tpassrun-gpucheck-")
    deadline = time.monotonic() + args.budget
    rows: dict[str, Row] = {}
    gpus = 0
    order = names
    background: list[tuple[str, subprocess.Popen, str, float, float]] = []
    print(f"gpu_check: {len(order)} checks, budget {args.budget:.0f} s, work directory {workdir}", flush=True)
    for name in order:
        _fn, timeout, alongside = CHECKS[name]
        timeout = min(timeout * args.timeout_scale, deadline - time.monotonic())
        if timeout <= 5:
            rows[name] = Row(name, "skipped: out of time (--budget)")
            continue
        print(f"gpu_check: {name} ...", flush=True)
        started = time.monotonic()
        proc, directory = launch(name, workdir, args.dry_run, gpus, args.rehearse)
        if alongside:
            background.append((name, proc, directory, timeout, started))
            continue
        rows[name] = collect(name, proc, directory, timeout, started)
        print(f"gpu_check: {name}: {rows[name].result} ({rows[name].seconds:.0f} s)", flush=True)
        if name == "environment":
            gpus = _gpus(workdir, args.dry_run)
    for name, proc, directory, timeout, started in background:
        rows[name] = collect(name, proc, directory, timeout, started)
    ordered = [rows[n] for n in order]
    ordered.append(hang_row(workdir, args.dry_run))
    started_groups = [pid for n in [*order, HANG] for pid in recorded(os.path.join(workdir, slug(n)))]
    left = gone(started_groups)
    ordered.append(Row("harness: nothing left running", "FAIL" if left else "ok",
                       f"{len(started_groups)} process group(s) started by the checks, none left" if not left else "",
                       f"still running: process groups {left}" if left else ""))
    for pgid in left:
        _signal_group(pgid, signal.SIGKILL)
    with open(os.path.join(workdir, "summary.json"), "w") as fh:
        json.dump([r.__dict__ for r in ordered], fh, indent=1)
    print()
    print(table(ordered))
    failed = any(r.failed for r in ordered)
    if failed or args.keep:
        print(f"\nlogs: {workdir} (one directory per check: log.txt, the jobs' outputs and event logs)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


def _gpus(workdir: str, dry_run: bool) -> int:
    if dry_run:
        return 0
    try:
        with open(os.path.join(workdir, "facts.json")) as fh:
            return int(json.load(fh).get("gpus", 0))
    except (OSError, ValueError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
