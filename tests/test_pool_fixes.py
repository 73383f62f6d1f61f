"""Issue 24's four findings of the two-jobs acceptance on separate hosts: each a pure or one-process test."""

from __future__ import annotations

import pytest

from tpassrun.launch.config import parse_args
from tpassrun.pool.ctl import check_local_addr
from tpassrun.pool.node import host_local, spare_node_argv, spare_node_env
from tpassrun.records.pool import JobSpec

SPEC = JobSpec(run_id="job", endpoint="127.0.0.1:2379", rdzv_conf="", nproc_per_node=2, entrypoint="/w/train.py",
               args=(), env={"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0",
                             "UCX_NET_DEVICES": "mlx5_0:1", "OMP_NUM_THREADS": "4", "LR": "0.1"})


def test_host_local_variables_set_on_the_pool_node_win_over_the_shipped_ones():
    """The acceptance on separate hosts had to give every namespace the same NIC name: the job's shipped
    GLOO_SOCKET_IFNAME replaced the pool node's own, so a pool node with another NIC name bound a link it lacks."""
    base = {"GLOO_SOCKET_IFNAME": "ib0", "CUDA_VISIBLE_DEVICES": "4,5", "NCCL_IB_HCA": "mlx5_2",
            "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    env = spare_node_env(SPEC, base, "runkey")
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_IB_HCA"] == "mlx5_2" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    # the node sets none: the job's value is the best guess there is
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    # the job's worker environment still wins for everything else
    assert env["OMP_NUM_THREADS"] == "4" and env["LR"] == "0.1" and env["PATH"] == "/bin"
    assert all(host_local(k) for k in ("TP_SOCKET_IFNAME", "HIP_VISIBLE_DEVICES", "NCCL_TOPO_FILE"))
    assert not any(host_local(k) for k in ("NCCL_DEBUG", "MASTER_PORT", "IFNAME", "OMP_NUM_THREADS"))


def test_pool_join_local_addr_reaches_the_nodes_it_starts_and_bad_input_is_one_line(capsys, monkeypatch):
    """The acceptance on separate hosts had to give the pool node its address through PET_LOCAL_ADDR: `tpassctl
    pool join` had no --local-addr, and the spare node it starts advertised getfqdn()."""
    from tpassrun.ops.ctl import main

    for member in (False, True):
        argv = spare_node_argv(SPEC, "/tmp/ev.jsonl", "python", member=member, local_addr="10.0.0.7")
        cfg = parse_args(argv[argv.index("tpassrun") + 1:], {}, accelerator_count=lambda _: 0)
        assert cfg.local_addr == "10.0.0.7" and cfg.training_script == "/w/train.py"
    assert "--local-addr" not in spare_node_argv(SPEC, "/tmp/ev.jsonl", "python")
    assert [check_local_addr(a) for a in ("10.0.0.7", "::1", "node7.cluster", "node7.cluster.", "n_1")] == \
        ["10.0.0.7", "::1", "node7.cluster", "node7.cluster.", "n_1"]
    monkeypatch.setenv("TPASSRUN_POOL_KEY", "pool-key-for-tests-0123456789")
    for bad in ("", "a b", "-x", "a..b", "host:29500", "x" * 64):
        with pytest.raises(ValueError):
            check_local_addr(bad)
        # no etcd is reached: the address is refused before anything runs
        assert main(["pool", "join", "p", "--rdzv-endpoint", "127.0.0.1:1", f"--local-addr={bad}"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("tpassctl pool: error: --local-addr") and err.count("\n") == 1, err
