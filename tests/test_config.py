"""Parsing a torchrun command line, and the worker env/argv built from it. No processes, no network."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tpassrun.cli import main
from tpassrun.launch import workerenv
from tpassrun.launch.config import (
    ConfigError,
    LaunchConfig,
    Std,
    cpu_count,
    parse_args,
    parse_rdzv_conf,
    parse_std,
    std_for,
    with_default_port,
)
from tpassrun.launch.workerenv import WorkerAssignment, entrypoint_name, worker_argv, worker_env


def parse(*argv: str, env: dict[str, str] | None = None, **kw) -> LaunchConfig:
    return parse_args(list(argv), env or {}, new_run_id=lambda: "UUID", **kw)


# ---------------------------------------------------------------- spellings, defaults, env


def test_defaults_are_torchruns():
    cfg = parse("train.py")
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 1, 1)
    assert cfg.max_restarts == 0 and cfg.monitor_interval == 0.1 and cfg.start_method == "spawn"
    assert cfg.role == "default" and cfg.event_log_handler == "null"
    assert cfg.redirects == Std.NONE and cfg.tee == Std.NONE and cfg.local_ranks_filter is None
    assert cfg.master_addr == "127.0.0.1" and cfg.master_port == 29500
    assert cfg.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT" and cfg.shutdown_timeout == 30
    assert cfg.python_exec == sys.executable and cfg.omp_num_threads is None
    assert cfg.training_script == "train.py" and cfg.training_script_args == ()
    # tpassrun's own
    assert (cfg.spares_per_node, cfg.spare_node, cfg.hang_timeout, cfg.tui) == (0, False, 0.0, None)
    assert (cfg.health_interval, cfg.straggler_factor, cfg.migrate_back, cfg.event_log) == (1.0, 0.0, False, None)


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node"])
def test_both_spellings(flag):
    assert parse(flag, "2", "t.py").nproc_per_node == 2
    assert parse(f"{flag}=2", "t.py").nproc_per_node == 2


def test_every_dual_spelling_flag_parses():
    both = {
        "--max-restarts": "3", "--monitor-interval": "0.5", "--start-method": "fork",
        "--event-log-handler": "console", "--log-dir": "/tmp/x", "--local-ranks-filter": "0",
        "--node-rank": "0", "--master-addr": "h", "--local-addr": "me", "--signals-to-handle": "SIGUSR1",
        "--shutdown-timeout": "5", "--rdzv-id": "job", "--rdzv-conf": "a=b",
    }
    for dash, value in both.items():
        under = "--" + dash[2:].replace("-", "_")
        assert parse(dash, value, "t.py") == parse(under, value, "t.py"), dash


def test_pet_env_fallbacks_and_flag_wins():
    env = {"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "4", "PET_ROLE": "trainer", "PET_STANDALONE": "1",
           "PET_MODULE": "1", "PET_TEE": "3", "PET_RDZV_CONF": "join_timeout=5"}
    cfg = parse("mod", env=env)
    assert cfg.nproc_per_node == 2 and cfg.max_restarts == 4 and cfg.role == "trainer"
    assert cfg.standalone and cfg.module and cfg.tee == Std.ALL
    assert cfg.rdzv_conf == {"join_timeout": "5"}   # standalone is c10d: no "timeout" (torchrun ignores it)
    assert parse("--max-restarts", "1", "t.py", env=env).max_restarts == 1
    assert not parse("t.py", env={"PET_MODULE": "0"}).module


def test_pet_boolean_uses_int():
    with pytest.raises(ConfigError, match="PET_STANDALONE"):
        parse("t.py", env={"PET_STANDALONE": "true"})


def test_abbreviations_like_torchrun(capsys):
    assert parse("--max-re", "2", "t.py").max_restarts == 2
    assert parse("--standal", "t.py").standalone
    with pytest.raises(SystemExit) as exc:
        parse("--nproc", "2", "t.py")
    assert exc.value.code == 2
    assert "ambiguous option: --nproc" in capsys.readouterr().err


def test_unknown_flag_is_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--bogus", "t.py")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tpassrun") and "unrecognized arguments: --bogus" in err


def test_script_args_pass_through_untouched():
    cfg = parse("--nproc-per-node", "1", "t.py", "--nproc-per-node", "7", "-m", "--standalone", "x y")
    assert cfg.training_script_args == ("--nproc-per-node", "7", "-m", "--standalone", "x y")
    assert cfg.nproc_per_node == 1 and not cfg.module


def test_tpassrun_flags():
    cfg = parse("--spares-per-node", "2", "--spare-node", "--hang-timeout", "30", "--event-log", "/tmp/e.jsonl",
                "--no-tui", "--etcd-bin", "/usr/bin/etcd", "--health-config", "h.toml", "--health-interval", "0.5",
                "--straggler-factor", "2.5", "--migrate-back", "t.py")
    assert (cfg.spares_per_node, cfg.spare_node, cfg.hang_timeout, cfg.event_log) == (2, True, 30.0, "/tmp/e.jsonl")
    assert (cfg.tui, cfg.etcd_bin, cfg.health_config) == (False, "/usr/bin/etcd", "h.toml")
    assert (cfg.health_interval, cfg.straggler_factor, cfg.migrate_back) == (0.5, 2.5, True)
    assert parse("--tui", "t.py").tui is True
    assert parse("t.py", env={"TPASSRUN_ETCD_BIN": "/e"}).etcd_bin == "/e"


# ---------------------------------------------------------------- nnodes, nproc


@pytest.mark.parametrize("value,expected", [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3))])
def test_nnodes(value, expected):
    cfg = parse("--nnodes", value, "--rdzv-backend", "etcd", "t.py")
    assert (cfg.min_nodes, cfg.max_nodes) == expected


@pytest.mark.parametrize("value", ["0", "3:2", "a:b", "1:2:3", "", "0:1", "-1"])
def test_bad_nnodes_is_one_line_config_error(value):
    with pytest.raises(ConfigError) as exc:
        parse(f"--nnodes={value}", "--rdzv-backend", "etcd", "t.py")
    assert "\n" not in str(exc.value) and "--nnodes" in str(exc.value)


def test_nproc_cpu_and_auto_without_accelerator():
    assert parse("--nproc-per-node", "cpu", "t.py").nproc_per_node == cpu_count()
    counted = []
    cfg = parse("--nproc-per-node", "auto", "t.py", accelerator_count=lambda k: counted.append(k) or 5)
    assert cfg.nproc_per_node == 5 and counted == ["auto"]


def test_nproc_auto_on_this_cpu_machine_is_cpu_count():
    assert parse("--nproc-per-node", "auto", "t.py").nproc_per_node == cpu_count()


def test_nproc_unsupported():
    with pytest.raises(ConfigError, match="Unsupported nproc_per_node value: lots"):
        parse("--nproc-per-node", "lots", "t.py")


# ---------------------------------------------------------------- rendezvous resolution


def test_explicit_standalone_ignores_rdzv_flags():
    cfg = parse("--standalone", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "mine", "t.py")
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.rdzv_id) == ("c10d", "localhost:0", "UUID")
    assert cfg.standalone and cfg.uses_embedded_etcd


def test_implicit_standalone():
    cfg = parse("t.py")
    assert cfg.standalone and cfg.rdzv_backend == "c10d" and cfg.rdzv_id == "UUID" and cfg.uses_embedded_etcd
    assert not parse("--master-port", "1234", "t.py").standalone
    assert not parse("--rdzv-endpoint", "h:5", "t.py").standalone


def test_static_single_node_with_master_port_uses_embedded_etcd():
    cfg = parse("--master-port", "1234", "--node-rank", "0", "t.py")
    assert cfg.rdzv_backend == "static" and cfg.rdzv_endpoint == "127.0.0.1:1234" and cfg.master_port == 1234
    assert cfg.rdzv_conf == {"timeout": "900", "rank": "0"} and cfg.uses_embedded_etcd and cfg.rdzv_id == "none"


def test_multi_node_c10d_without_endpoint_is_a_clear_error():
    with pytest.raises(ConfigError, match="pass --rdzv-endpoint"):
        parse("--nnodes", "2", "--rdzv-backend", "c10d", "--master-port", "1", "t.py")


def test_multi_node_static_hosts_its_etcd_next_to_the_master_port():
    # torchrun's static rank-0 agent hosts a store at master_addr:master_port; tpassrun's agent on that
    # machine hosts an etcd next to it, and every agent uses it.
    cfg = parse("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5", "--master-port", "1234", "t.py")
    assert cfg.etcd_endpoint == "10.0.0.5:1235" and cfg.host_etcd and cfg.master_port == 1234
    # ... and with an endpoint: the workers' store is the endpoint (torchrun's), the etcd next to it
    cfg = parse("--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "10.0.0.6:7000", "t.py")
    assert cfg.etcd_endpoint == "10.0.0.6:7001" and cfg.host_etcd and cfg.rdzv_endpoint == "10.0.0.6:7000"
    assert parse("--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "[::1]:7000",
                 "t.py").etcd_endpoint == "[::1]:7001"
    # one node: the store on the endpoint, the embedded etcd
    assert parse("--rdzv-backend", "static", "--rdzv-endpoint", "h:7000", "t.py").uses_embedded_etcd
    with pytest.raises(ConfigError, match="needs a port"):   # torchrun: "Port is absent in endpoint"
        parse("--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "h", "t.py")


def test_c10d_endpoint_is_hosted_by_the_agent_on_its_machine_etcd_endpoints_never():
    assert parse("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:7", "t.py").host_etcd
    assert not parse("--rdzv-backend", "etcd", "--rdzv-endpoint", "h:7", "t.py").host_etcd
    assert not parse("--standalone", "t.py").host_etcd


@pytest.mark.parametrize("backend,endpoint,etcd", [
    ("etcd", "h", "h:2379"), ("etcd-v2", "h:1", "h:1"), ("etcd", "", "localhost:2379"),
    ("c10d", "h", "h:29400"), ("c10d", "h:7", "h:7"), ("static", "h:7", None), ("c10d", "", None),
])
def test_etcd_endpoint_resolution(backend, endpoint, etcd):
    cfg = parse("--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--master-port", "1", "t.py")
    assert cfg.rdzv_backend == backend and cfg.etcd_endpoint == etcd


def test_port_zero_endpoint_is_one_nodes_private_rendezvous():
    assert parse("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "t.py").uses_embedded_etcd
    with pytest.raises(ConfigError, match="port 0"):
        parse("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "t.py")


def test_unknown_backend():
    with pytest.raises(ConfigError, match="unknown backend"):
        parse("--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h", "t.py")


def test_with_default_port():
    assert with_default_port("[::1]", 5) == "[::1]:5" and with_default_port("[::1]:6", 5) == "[::1]:6"
    assert with_default_port("host", 5) == "host:5" and with_default_port("host:6", 5) == "host:6"


def test_rdzv_conf():
    assert parse_rdzv_conf(" a = 1 ,b=x=y") == {"a": "1", "b": "x=y"}
    assert parse_rdzv_conf("") == {}
    for bad in ("a=", "a", "=1", "a=1,,b=2"):
        with pytest.raises(ConfigError):
            parse_rdzv_conf(bad)
    assert parse("--rdzv-conf", "timeout=5", "--master-port", "1", "t.py").rdzv_conf["timeout"] == "5"   # static


# ---------------------------------------------------------------- other validation


def test_no_python_with_module_is_an_error_unless_run_path():
    with pytest.raises(ConfigError, match="'--no-python' flag and the '--module'"):
        parse("--no-python", "-m", "t.py")
    assert parse("--no-python", "-m", "--run-path", "/abs/t.py").run_path


@pytest.mark.parametrize("argv,match", [
    (["--max-restarts", "-1"], "max-restarts"), (["--monitor-interval", "0"], "monitor-interval"),
    (["--local-ranks-filter", "0,x"], "local_ranks_filter"), (["-r", "12"], "does not match"),
    (["--logs-specs", "custom"], "logs-specs"), (["--shutdown-timeout", "-1"], "shutdown-timeout"),
])
def test_bad_values(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(*argv, "t.py")


def test_std_specs():
    assert parse_std("0") == Std.NONE and parse_std("3") == Std.ALL
    spec = parse_std("0:3,1:1")
    assert spec == {0: Std.ALL, 1: Std.OUT}
    assert std_for(spec, 1) == Std.OUT and std_for(spec, 5) == Std.NONE and std_for(Std.ERR, 9) == Std.ERR
    with pytest.raises(ConfigError):
        parse_std("10:1")  # torchrun's regex allows single-digit local ranks only


def test_duplicate_filters_escape_commas():
    cfg = parse("--duplicate-stdout-filters", "a,,b,c", "t.py")
    assert cfg.duplicate_stdout_filters == ("a,b", "c")


def test_shutdown_timeout_from_env():
    assert parse("t.py", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout == 7
    assert parse("--shutdown-timeout", "3", "t.py", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).shutdown_timeout == 3


def test_omp_rule():
    assert parse("--nproc-per-node", "2", "t.py").omp_num_threads == "1"
    assert parse("--nproc-per-node", "1", "t.py").omp_num_threads is None
    assert parse("--nproc-per-node", "2", "t.py", env={"OMP_NUM_THREADS": "4"}).omp_num_threads is None


# ---------------------------------------------------------------- worker argv


def test_worker_argv_variants():
    py = sys.executable
    assert worker_argv(parse("t.py", "--a", "1"), 0) == [py, "-u", "t.py", "--a", "1"]
    assert worker_argv(parse("-m", "pkg.mod", "x"), 0) == [py, "-u", "-m", "pkg.mod", "x"]
    assert worker_argv(parse("--no-python", "/bin/echo", "x"), 0) == ["/bin/echo", "x"]
    argv = worker_argv(parse("--run-path", "/abs/t.py", "x"), 0)
    assert argv[:3] == [py, "-u", "-c"] and argv[4:] == ["/abs/t.py", "x"]
    assert worker_argv(parse("t.py", env={"PYTHON_EXEC": "/opt/py"}), 0)[0] == "/opt/py"


def test_spare_argv_goes_through_sparestart_unless_it_cannot():
    py = sys.executable
    assert worker_argv(parse("t.py", "--a"), 2, spare=True) == [py, "-u", "-m", "tpassrun.launch.sparestart", "t.py", "--a"]
    assert worker_argv(parse("-m", "pkg.mod", "x"), 2, spare=True)[3:] == ["tpassrun.launch.sparestart", "-m", "pkg.mod", "x"]
    assert worker_argv(parse("--run-path", "/abs/t.py"), 2, spare=True)[3:] == ["tpassrun.launch.sparestart", "/abs/t.py"]
    assert worker_argv(parse("--no-python", "/bin/echo", "x"), 2, spare=True) == ["/bin/echo", "x"]
    # a foreign interpreter may not have tpassrun: the spare runs the script as it is
    assert worker_argv(parse("t.py", env={"PYTHON_EXEC": "/opt/py"}), 2, spare=True) == ["/opt/py", "-u", "t.py"]


def test_local_rank_macro():
    cfg = parse("--nproc-per-node", "2", "t_${local_rank}.py", "--out=${local_rank}.log", "$$HOME", "$other")
    assert worker_argv(cfg, 1)[2:] == ["t_1.py", "--out=1.log", "$HOME", "$other"]


def test_run_path_bootstrap_runs_script_as_main(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys; print(__name__, sys.argv[1:])")
    argv = worker_argv(parse("--run-path", str(script), "a", "b"), 0)
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "__main__ ['a', 'b']"


def test_entrypoint_name():
    assert entrypoint_name(parse("/x/t.py", "a")) == "/x/t.py"
    assert entrypoint_name(parse("-m", "pkg.mod")) == "pkg.mod"
    assert entrypoint_name(parse("--no-python", "/bin/echo")) == "/bin/echo"
    assert entrypoint_name(parse("--run-path", "/x/t.py")) == "run_script_path"


# ---------------------------------------------------------------- worker env


def assignment(local_rank: int = 1, **kw) -> WorkerAssignment:
    base = dict(local_rank=local_rank, rank=3, group_rank=1, role_rank=3, role_world_size=4, local_world_size=2,
                world_size=4, group_world_size=2, master_addr="10.0.0.1", master_port=4567, restart_count=2,
                error_file="/logs/attempt_2/1/error.json", use_agent_store=True)
    base.update(kw)
    return WorkerAssignment(**base)


def test_worker_env_has_exactly_torchruns_variables():
    cfg = parse("--nproc-per-node", "2", "--max-restarts", "3", "--role", "trainer", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", "h", "--rdzv-id", "job7", "t.py")
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "8"}
    env = worker_env(cfg, assignment(extra={"TPASSRUN_SLOT": "1"}), base)
    assert env == {
        "PATH": "/bin", "OMP_NUM_THREADS": "8", "TPASSRUN_SLOT": "1",
        "LOCAL_RANK": "1", "RANK": "3", "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_NAME": "trainer",
        "ROLE_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4567", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCHELASTIC_ERROR_FILE": "/logs/attempt_2/1/error.json",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
    assert base == {"PATH": "/bin", "OMP_NUM_THREADS": "8"}  # never mutated


def test_worker_env_omp_rule_warns_once(caplog):
    workerenv._warn_omp_once.cache_clear()
    cfg = parse("--nproc-per-node", "2", "t.py")
    with caplog.at_level(logging.WARNING, logger="tpassrun.launch.workerenv"):
        envs = [worker_env(cfg, assignment(local_rank=i), {}) for i in range(2)]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["1", "1"]
    assert sum("OMP_NUM_THREADS" in r.getMessage() for r in caplog.records) == 1
    assert "OMP_NUM_THREADS" not in worker_env(parse("t.py"), assignment(), {})


def test_worker_env_inherits_nccl_and_cuda_devices():
    env = worker_env(parse("t.py"), assignment(), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "CUDA_VISIBLE_DEVICES": "2,3"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["LOCAL_RANK"] == "1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert worker_env(parse("t.py"), assignment(use_agent_store=False), {})["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_worker_env_virtual_local_rank():
    cfg = parse("--virtual-local-rank", "--nproc-per-node", "2", "t.py")
    env = worker_env(cfg, assignment(local_rank=1), {})
    assert env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "1"
    env = worker_env(cfg, assignment(local_rank=1), {"CUDA_VISIBLE_DEVICES": "4, 6"})
    assert env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "6"
    with pytest.raises(ConfigError, match="exceeds available GPUs"):
        worker_env(cfg, assignment(local_rank=2), {"CUDA_VISIBLE_DEVICES": "4,6"})


def test_worker_env_devnull_error_file_and_signals():
    cfg = parse("--signals-to-handle", "SIGUSR1,SIGTERM", "t.py")
    env = worker_env(cfg, assignment(error_file=""), {})
    assert env["TORCHELASTIC_ERROR_FILE"] == "" and env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1,SIGTERM"


# ---------------------------------------------------------------- against torchrun's own parser


TORCHRUN_ARGVS = [
    ["t.py"],
    ["--nproc_per_node=2", "--max-re", "2", "-r", "0:1,1:2", "-t", "3", "t.py", "a", "--b"],
    ["--nnodes", "1:3", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv_id", "j", "-m", "pkg", "x"],
    ["--master-port", "1234", "--node_rank", "0", "--role", "r", "--local-ranks-filter", "0,1", "t.py"],
    ["--standalone", "--monitor-interval", "0.5", "--signals-to-handle", "SIGUSR1", "--virtual-local-rank", "t.py"],
]
COMPARED = ["nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "standalone", "max_restarts",
            "monitor_interval", "role", "module", "no_python", "run_path", "node_rank", "master_addr", "master_port",
            "signals_to_handle", "virtual_local_rank", "training_script", "training_script_args", "redirects", "tee"]


@pytest.mark.timeout(60)
def test_raw_parse_matches_torchruns_parser(monkeypatch):
    """Our argparse layer and torchrun's give the same raw values (torch imported only here)."""
    from tpassrun.launch.config import build_parser

    monkeypatch.setenv("PET_MAX_RESTARTS", "1")
    from torch.distributed.run import get_args_parser

    theirs_parser, ours_parser = get_args_parser(), build_parser(dict(os.environ))
    for argv in TORCHRUN_ARGVS:
        theirs, ours = theirs_parser.parse_args(argv), ours_parser.parse_args(argv)
        for name in COMPARED:
            assert getattr(ours, name) == getattr(theirs, name), (argv, name)


# ---------------------------------------------------------------- cli


def test_cli_config_error_is_one_line_and_torchruns_exit_1(capsys):
    assert main(["--nnodes", "3:2", "t.py"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tpassrun: error: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["--rdzv-backend", "nosuch", "--rdzv-endpoint", "h:1", "t.py"],  # unknown backend
    ["--logs-specs", "nosuch", "t.py"],
    ["--nproc-per-node", "lots", "t.py"],
    ["--nnodes", "1:2:3", "t.py"],
    ["--shutdown-timeout", "-1", "t.py"],
    ["--no-python", "-m", "t.py"],
    ["--event-log-handler", "nosuch", "t.py"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:port", "t.py"],  # malformed endpoint: at once, not after 60 s
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1:2", "t.py"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", ":29400", "t.py"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:70000", "t.py"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "a/b", "t.py"],
])
def test_rejected_values_exit_1_like_torchrun_with_one_line(argv, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("tpassrun: error: ") and err.count("\n") == 1, err


def test_logs_specs_default_is_torchruns_own_plugin():
    assert parse("--logs-specs", "default", "t.py").logs_specs == "default"
    assert parse("--logs_specs=default", "t.py").logs_specs == "default"


def test_run_id_with_slash_is_fine_when_standalone_ignores_it():
    assert parse("--standalone", "--rdzv-id", "a/b", "t.py").rdzv_id == "UUID"


@pytest.mark.parametrize("value", ['"5\'"', "'5'", "five"])
def test_quoted_timeout_is_ignored_where_torchrun_ignores_it(value):
    # c10d's dynamic handler never reads "timeout": torchrun runs whatever its value
    cfg = parse("--rdzv-conf", f"timeout={value}", "t.py")
    assert "timeout" not in cfg.rdzv_conf
    cfg = parse("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", f"timeout={value},x=1", "t.py")
    assert cfg.rdzv_conf == {"x": "1"}
    # the legacy etcd and static handlers int() it: the value is kept and the agent rejects it, like torchrun
    assert parse("--rdzv-backend", "etcd", "--rdzv-conf", f"timeout={value}", "t.py").rdzv_conf["timeout"] == value


@pytest.mark.parametrize("endpoint", ["h", "h:1", "10.0.0.1:29400", "[::1]:5", "[::1]", "::1:29400", "localhost:0"])
def test_wellformed_endpoints_pass(endpoint):
    parse("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "t.py")


@pytest.mark.parametrize("backend,endpoint", [
    ("c10d", ":::"), ("c10d", "[::1"), ("etcd", ":::"), ("etcd", "[::1"), ("etcd", "[::1]x"), ("etcd", "h:65536"),
    ("etcd", "h:-1"), ("etcd", "h:"), ("etcd", "h:0"), ("etcd", "[fe80::zz]:1"), ("etcd", "fe80::1"),
    ("etcd", "a b:1"), ("etcd", "ftp://h:1"), ("etcd", "h1:2379,:::"), ("etcd", "h1:2379,[::1"),
    ("etcd", "h1,h2:99999"), ("c10d", "h1:1,h2:2"), ("c10d", "http://h:1"), ("static", "h:1,h:2"),
])
def test_malformed_endpoints_are_one_line_at_once(backend, endpoint, capsys):
    """Issue 27: ``--rdzv-endpoint :::`` or ``[::1`` was misparsed and waited 64 s for etcd before its error; every
    member of an etcd list is checked the same way, before anything connects."""
    assert main(["--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "t.py"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tpassrun: error: --rdzv-endpoint={endpoint}") and err.count("\n") == 1, err


@pytest.mark.parametrize("endpoint,etcd", [
    ("etcd1:2379,etcd2:2379", "etcd1:2379,etcd2:2379"),           # the README's multi-node example (issue 30)
    ("etcd1,etcd2:2380, etcd3", "etcd1:2379,etcd2:2380,etcd3:2379"),
    ("http://10.0.0.1:2379,http://10.0.0.2", "http://10.0.0.1:2379,http://10.0.0.2:2379"),
    ("https://[fd00::1]:2379,[fd00::2]", "https://[fd00::1]:2379,[fd00::2]:2379"),
])
def test_an_etcd_cluster_is_a_list_of_members(endpoint, etcd):
    cfg = parse("--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "j", "t.py")
    assert cfg.etcd_endpoint == etcd and not cfg.host_etcd


# ---------------------------------------------------------------- preflight (issue 11: bad input is one line)


def _preflight_main(tmp_path, *argv):
    return main(list(argv) + [str(tmp_path / "t.py")])


def test_missing_cert_is_one_line(tmp_path, capsys):
    rc = main(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-conf", f"cacert={tmp_path}/none.pem",
               "t.py"])
    err = capsys.readouterr().err
    assert rc == 1 and "cacert=" in err and err.count("\n") == 1


def test_uncreatable_log_dir_and_event_log_are_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv in (["--log-dir", str(blocker / "logs")], ["--event-log", str(blocker / "sub" / "e.jsonl")],
                 ["--event-log", str(tmp_path)]):
        assert main(argv + ["t.py"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("tpassrun: error: ") and err.count("\n") == 1, err


def test_log_dir_and_event_log_are_created(tmp_path):
    from tpassrun.launch.config import preflight

    preflight(parse("--log-dir", str(tmp_path / "a" / "b"), "--event-log", str(tmp_path / "c" / "e.jsonl"), "t.py"))
    assert (tmp_path / "a" / "b").is_dir() and (tmp_path / "c" / "e.jsonl").is_file()


def test_missing_or_invalid_health_config_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("rules = [ {")
    for path in (tmp_path / "missing.toml", bad):
        assert main(["--health-config", str(path), "t.py"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("tpassrun: error: --health-config") and err.count("\n") == 1, err


def test_cli_usage_error_exit_2(capsys):
    assert main(["--bogus", "t.py"]) == 2
    assert main(["--help"]) == 0


# ---------------------------------------------------------------- roles (torchrun's _assign_worker_ranks)


def test_role_ranks_count_per_role_in_group_rank_order():
    from types import SimpleNamespace as M

    from tpassrun.launch.workerenv import role_ranks

    members = [M(group_rank=0, rank_offset=0, nproc=1, role="master"),
               M(group_rank=1, rank_offset=1, nproc=2, role="trainer"),
               M(group_rank=2, rank_offset=3, nproc=3, role="ps"),
               M(group_rank=3, rank_offset=6, nproc=2, role="trainer")]
    got = [role_ranks(members, r, 8) for r in range(8)]
    assert got == [(0, 1), (0, 4), (1, 4), (0, 3), (1, 3), (2, 3), (2, 4), (3, 4)]
    assert role_ranks(members, -1, 8) == (-1, 8)  # a spare


def test_shard_mirror_flags():
    cfg = parse("t.py")
    assert (cfg.shard_mirror_interval, cfg.mirror_max_bytes) == (None, 1 << 30)     # None: auto
    assert parse("--shard-mirror-interval", "auto", "t.py").shard_mirror_interval is None
    cfg = parse("--shard-mirror-interval", "4", "--mirror-max-bytes", "24G", "t.py")
    assert (cfg.shard_mirror_interval, cfg.mirror_max_bytes) == (4, 24 << 30)
    assert parse("--mirror_max_bytes=512M", "--shard_mirror_interval=0", "t.py").mirror_max_bytes == 512 << 20
    with pytest.raises(ConfigError, match="shard-mirror-interval"):
        parse("--shard-mirror-interval", "-1", "t.py")
    with pytest.raises(ConfigError, match="shard-mirror-interval"):
        parse("--shard-mirror-interval", "sometimes", "t.py")
    for bad in ("lots", "1K"):
        with pytest.raises((ConfigError, SystemExit)):
            parse("--mirror-max-bytes", bad, "t.py")


@pytest.mark.parametrize("backend", ["c10d", "etcd-v2"])
def test_dynamic_backends_join_timeout_ignores_timeout(backend):
    """torchrun's c10d/etcd-v2 handler reads join_timeout (600 s), never "timeout": `--rdzv-conf timeout=5` with a
    second agent 8 s late succeeds there, so the rendezvous here must not time out after 5 s either."""
    from tpassrun.rendezvous import RendezvousSettings

    cfg = parse("--rdzv-backend", backend, "--rdzv-endpoint", "h:1", "--nnodes", "2", "--rdzv-conf", "timeout=5",
                "t.py")
    assert RendezvousSettings.from_conf("r", 2, 2, cfg.rdzv_conf).join_timeout == 600
    cfg = parse("--rdzv-backend", backend, "--rdzv-endpoint", "h:1", "--rdzv-conf", "timeout=5,join_timeout=7", "t.py")
    assert RendezvousSettings.from_conf("r", 1, 1, cfg.rdzv_conf).join_timeout == 7
    # the legacy etcd and static handlers do read it
    for other in ("etcd", "static"):
        cfg = parse("--rdzv-backend", other, "--rdzv-endpoint", "h:1", "--rdzv-conf", "timeout=5", "t.py")
        assert RendezvousSettings.from_conf("r", 1, 1, cfg.rdzv_conf).join_timeout == 5
