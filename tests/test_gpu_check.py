"""``scripts/gpu_check.sh --dry-run`` (issue 29): the GPU check's harness on CPU, so the script cannot rot.

Every GPU row says "skipped: no GPU"; what needs no GPU runs for real: argument parsing, a process per check,
the layout decisions through the real launcher, a check that hangs (deaf to SIGTERM, with a child in a
session of its own) stopped at its timeout with that child, nothing left running, the table.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "gpucheck"))

import harness  # noqa: E402

GPU_ROWS = ["nvml", "swap: planned", "swap: SIGKILL", "shard mirror", "nccl (2 GPUs)", "megatron DistOpt (2 GPUs)",
            "transfer 1 GiB", "transparent: cuda-checkpoint", "swap: compile joiner"]
STREAM = "stream: auth-only, pinned"     # needs no GPU: >= 4 cores (issue 42)


def _rows(output: str) -> dict[str, list[str]]:
    table = output[output.index("check "):]
    return {cells[0]: cells for cells in ([c.strip() for c in line.split("|")] for line in table.splitlines()[2:])
            if len(cells) == 4}


def test_the_dry_run_prints_the_table_with_every_gpu_row_skipped(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = _rows(run.stdout)
    assert list(rows) == ["environment", "nvml", "layout", *GPU_ROWS[1:-1], STREAM, GPU_ROWS[-1], harness.HANG,
                          "harness: nothing left running"], rows
    assert all(rows[name][1] == "skipped: no GPU" for name in GPU_ROWS), rows
    assert rows[STREAM][1] == "skipped: dry run (the bench measures this machine's cores)", rows[STREAM]
    for name in ("environment", "layout", harness.HANG, "harness: nothing left running"):
        assert rows[name][1] == "ok" and rows[name][3] == "", rows[name]
    assert "refused without TPASSRUN_SHARE_GPUS=1" in rows["layout"][2]
    workdir = re.search(r"work directory (\S+)", run.stdout).group(1)
    assert not os.path.exists(workdir)                 # removed: nothing failed
    assert os.listdir(tmp_path) == []


def test_bad_arguments_get_one_line_and_a_non_zero_exit(tmp_path):
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--only", "nope"],
                         env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "unknown check(s) ['nope']" in run.stderr


def test_the_table_and_the_rows():
    rows = [harness.Row("a", "ok", "1 GB/s"), harness.Row("bb", "FAIL", where="boom"),
            harness.Row("c", "skipped: no GPU")]
    text = harness.table(rows).splitlines()
    assert text[0].split("|")[0].strip() == "check" and text[1].startswith("---")
    assert text[3].endswith("| boom") and [r.failed for r in rows] == [False, True, False]
    assert harness.first_line("\n  first\nsecond") == "first" and harness.slug("swap: SIGKILL") == "swap__SIGKILL"


def test_a_jobs_most_telling_line():
    sys.path.insert(0, str(REPO / "scripts" / "gpucheck"))
    from support import last_error

    log = "step 1\nTraceback (most recent call last):\n  File x\nRuntimeError: CUDA error: out of memory\nexit\n"
    assert last_error(log) == "RuntimeError: CUDA error: out of memory"
    assert last_error("all fine\n") == "all fine" and last_error("") == "(empty log)"


def test_state_trees_are_compared_to_the_last_bit():
    import torch

    sys.path.insert(0, str(REPO / "scripts" / "gpucheck"))
    from support import first_difference

    zero = {"rank": 1, "shard": torch.ones(3), "inner": {"state": {0: {"exp_avg": torch.zeros(2)}}}}
    same = {"rank": 1, "shard": torch.ones(3), "inner": {"state": {0: {"exp_avg": torch.zeros(2)}}}}
    assert first_difference(zero, same, "optimizer") is None
    same["inner"]["state"][0]["exp_avg"] = torch.tensor([0.0, 1e-45])
    assert first_difference(zero, same, "optimizer") == "optimizer.inner.state.0.exp_avg differs"
    assert first_difference([1, 2], [1], "x") == "x has 2 entries against 1"
    assert first_difference({"a": 1}, {"b": 1}, "s").startswith("s has keys")


def test_a_recomputed_step_counts_once_and_must_repeat_its_loss():
    """A ZeRO rank killed after its last mirror refresh: the survivors roll back and log a step again."""
    sys.path.insert(0, str(REPO / "scripts" / "gpucheck"))
    import support

    class Log:
        def __init__(self, rows):
            self.rows = rows

        def losses(self, _rank):
            return [{"step": s, "loss": loss} for s, loss in self.rows]

    assert support.logged(Log([(8, 0.5), (9, 0.25), (9, 0.25), (10, 0.125)]), 0) == {8: 0.5, 9: 0.25, 10: 0.125}
    try:
        support.logged(Log([(9, 0.25), (9, 0.3)]), 1)
    except support.Failed as exc:
        assert "step 9 recomputed with another loss" in str(exc)
    else:
        raise AssertionError("a recomputed step with another loss passed")
