"""Spares and devices (issue 13 item 6), decided purely: scripted GPU counts through the NVML interface and
``CUDA_VISIBLE_DEVICES``; no GPU is needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tpassrun import cli
from tpassrun.health import device_for_local_rank, nvml_device_count
from tpassrun.launch.devices import check_layout, node_devices, slot_env, visible_devices

sys.path.insert(0, str(Path(__file__).parent))
from test_health_nvml import FakeGpu, FakeNvml, real

EIGHT = [str(i) for i in range(8)]


@pytest.mark.parametrize("cuda_visible, nvml, expected", [
    (None, 8, EIGHT),
    (None, 0, None),
    (None, None, None),                                 # no NVML: a CPU node
    ("4,5,6,7", 8, ["4", "5", "6", "7"]),               # the variable wins over NVML
    ("GPU-aa,GPU-bb", None, ["GPU-aa", "GPU-bb"]),
    ("0,1,-1,3", 8, ["0", "1"]),                        # CUDA stops at the first invalid entry
    ("", 8, None),
    ("-1", 8, None),
])
def test_visible_devices(cuda_visible, nvml, expected):
    assert visible_devices(cuda_visible, nvml) == expected


def test_nvml_device_count_through_the_nvml_interface():
    fake = FakeNvml([FakeGpu() for _ in range(8)])
    assert nvml_device_count(fake) == 8
    assert fake.calls == ["nvmlInit", "nvmlDeviceGetCount", "nvmlShutdown"]
    assert nvml_device_count(FakeNvml([], init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND)) is None
    assert nvml_device_count(FakeNvml([], init_error=real.NVML_ERROR_DRIVER_NOT_LOADED)) is None
    with pytest.raises(real.NVMLError):
        nvml_device_count(FakeNvml([], init_error=real.NVML_ERROR_UNKNOWN))
    assert node_devices({}, lambda: 8) == EIGHT and node_devices({"CUDA_VISIBLE_DEVICES": "3"}, lambda: 8) == ["3"]


def test_a_layout_needing_more_gpus_than_the_node_has_is_refused_with_the_alternatives():
    error = check_layout(8, 1, EIGHT)
    assert error is not None and "\n" not in error
    assert error.startswith("--nproc-per-node 8 + --spares-per-node 1 needs 9 GPUs, but this node has 8")
    assert "--nproc-per-node 7 --spares-per-node 1" in error and "--spare-node" in error
    assert check_layout(7, 1, EIGHT) is None and check_layout(6, 2, EIGHT) is None
    assert check_layout(4, 1, ["4", "5", "6", "7"]) is not None      # CUDA_VISIBLE_DEVICES narrows the node
    assert check_layout(8, 1, None) is None                          # CPU: gloo ranks need no GPU
    assert check_layout(16, 0, EIGHT) is None                        # no spares: torchrun's rules
    assert "--spares-per-node 0" in check_layout(2, 1, ["0", "1"])


def test_tpassrun_refuses_the_layout_at_start_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(EIGHT))
    assert cli.main(["--nproc-per-node", "8", "--spares-per-node", "1", "train.py"]) == cli.REJECTED_VALUE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tpassrun: error: --nproc-per-node 8 + --spares-per-node 1")


def test_the_readme_headline_fits_an_8_gpu_node():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    headline = next(line for line in readme.splitlines() if line.startswith("tpassrun ") and "--spares-per-node" in line)
    words = headline.split()
    nproc = int(words[words.index("--nproc-per-node") + 1])
    spares = int(words[words.index("--spares-per-node") + 1])
    assert check_layout(nproc, spares, EIGHT) is None, headline


def test_each_spare_slot_sees_only_its_own_gpu_and_local_rank_0():
    for slot in (7, 8):
        assert slot_env(slot, slot, EIGHT + ["8"], spare=True, virtual_local_rank=False) == {
            "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": str(slot)}
    assert slot_env(1, 1, ["GPU-aa", "GPU-bb"], spare=True, virtual_local_rank=False)["CUDA_VISIBLE_DEVICES"] == "GPU-bb"
    assert slot_env(8, 8, None, spare=True, virtual_local_rank=False) == {}          # CPU: unchanged


def test_an_active_rank_in_its_own_slot_gets_torchruns_environment():
    assert all(slot_env(k, k, EIGHT, spare=False, virtual_local_rank=False) == {} for k in range(8))
    assert slot_env(3, 3, EIGHT, spare=False, virtual_local_rank=True) == {"LOCAL_RANK": "0",
                                                                           "CUDA_VISIBLE_DEVICES": "3"}
    assert slot_env(9, 9, EIGHT, spare=False, virtual_local_rank=False) == {}      # more ranks than GPUs


def _effective_gpu(env: dict[str, str], local_rank: int, devices: list[str]) -> str:
    """The physical GPU ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` picks."""
    visible = env.get("CUDA_VISIBLE_DEVICES", ",".join(devices)).split(",")
    return visible[int(env.get("LOCAL_RANK", local_rank))]


@pytest.mark.parametrize("devices", [EIGHT, ["2", "3", "5", "7", "11", "13", "17", "19"]])
@pytest.mark.parametrize("tainted", [{0}, {3}, {7}, {2, 5}])
def test_a_restart_after_a_taint_never_puts_a_rank_on_the_tainted_gpu(devices, tainted):
    """The agent's restart places local ranks 0..6 on the healthy slots in order (agent/workers.py: WorkerSpawning.spawn_generation);
    every rank must land on its slot's GPU: distinct, and never a quarantined slot's."""
    nproc = 8 - len(tainted)
    usable = [s for s in range(8) if s not in tainted]
    gpus = []
    for local_rank, slot in enumerate(usable[:nproc]):
        env = slot_env(slot, local_rank, devices, spare=False, virtual_local_rank=False)
        assert env.get("LOCAL_RANK", str(local_rank)) == str(local_rank)    # the script's LOCAL_RANK is kept
        gpus.append(_effective_gpu(env, local_rank, devices))
        assert gpus[-1] == devices[slot]
    assert len(set(gpus)) == nproc and not {devices[s] for s in tainted} & set(gpus)


def test_the_health_monitor_and_the_slots_agree_on_which_gpu_a_slot_owns():
    devices = visible_devices("4,5,6,7", None)
    for slot, gpu in enumerate(devices):
        assert device_for_local_rank(slot, "4,5,6,7") == f"gpu{gpu}"
        assert slot_env(slot, slot, devices, spare=True, virtual_local_rank=False)["CUDA_VISIBLE_DEVICES"] == gpu


def test_slots_share_gpus_only_when_asked_and_each_sees_its_gpu_as_cuda_0():
    """TPASSRUN_SHARE_GPUS=1 (issue 29): 2 ranks + 1 spare on one GPU for tests and single-GPU workstations;
    refused without it, as before. Every slot of a shared GPU sees that GPU alone, with LOCAL_RANK=0."""
    one = node_devices({"CUDA_VISIBLE_DEVICES": "0"}, lambda: 1, slots=3)
    assert one == ["0"] and check_layout(2, 1, one) is not None
    assert "TPASSRUN_SHARE_GPUS=1" in check_layout(2, 1, one)
    shared = node_devices({"CUDA_VISIBLE_DEVICES": "0", "TPASSRUN_SHARE_GPUS": "1"}, lambda: 1, slots=3)
    assert shared == ["0", "0", "0"] and check_layout(2, 1, shared) is None
    for slot in range(3):
        assert slot_env(slot, slot, shared, spare=slot == 2, virtual_local_rank=False) == {
            "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "0"}
    two = node_devices({"TPASSRUN_SHARE_GPUS": "1"}, lambda: 2, slots=3)
    assert two == ["0", "1", "0"]                                     # slot i -> GPU i mod n: the spare shares 0
    assert slot_env(1, 1, two, spare=False, virtual_local_rank=False) == {}   # GPU 1 is rank 1's alone: torchrun's
    assert node_devices({"TPASSRUN_SHARE_GPUS": "1"}, lambda: 8, slots=3) == EIGHT   # enough GPUs: no sharing
    assert node_devices({"TPASSRUN_SHARE_GPUS": "1"}, lambda: None, slots=3) is None  # CPU node: nothing to share


def test_the_launcher_takes_a_shared_layout_only_with_the_opt_in(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("TPASSRUN_SHARE_GPUS", raising=False)
    assert cli.main(["--nproc-per-node", "2", "--spares-per-node", "1", "train.py"]) == cli.REJECTED_VALUE
    assert "needs 3 GPUs, but this node has 1" in capsys.readouterr().err
    monkeypatch.setenv("TPASSRUN_SHARE_GPUS", "1")
    from tpassrun.launch.config import parse_args
    cfg = parse_args(["--nproc-per-node", "2", "--spares-per-node", "1", "train.py"], {})
    cli._check_devices(cfg)                                           # no ConfigError: the layout is taken
