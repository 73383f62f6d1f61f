"""Issue 24's four findings of the two-jobs acceptance on separate hosts: each a pure or one-process test."""

from __future__ import annotations

from tpassrun.pool.node import host_local, spare_node_env
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
