"""The transparent mode's pure decisions (tpassrun/snapshot/plan.py) and its availability probe against binaries
that are not a usable CRIU (no root needed, no CRIU needed)."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from tpassrun.launch.config import ConfigError, parse_args
from tpassrun.settings import envnames as E
from tpassrun.snapshot import (
    DEFAULT_CRIU,
    Move,
    criu_candidates,
    dump_argv,
    judge,
    on_death,
    on_taint,
    parse_version,
    probe,
    restore_argv,
    snapshot_due,
)


def test_candidates_operator_word_is_final() -> None:
    assert criu_candidates({E.TPASSRUN_CRIU: "/x/criu"}, "/usr/sbin/criu") == ["/x/criu"]
    assert criu_candidates({}, "/usr/sbin/criu") == [DEFAULT_CRIU, "/usr/sbin/criu"]
    assert criu_candidates({}, None) == [DEFAULT_CRIU]


def test_version_and_verdicts() -> None:
    assert parse_version("Version: 4.2.1\n") == (4, 2, 1)
    assert parse_version("GitID: x\n") is None
    assert judge("c", None, "", None, "").reason == "c cannot be run"
    old = judge("c", 0, "Version: 3.17\n", 0, "Looks good.")
    assert not old.usable and "CRIU 3.17; >= 4.2 is needed" in old.reason
    bad = judge("c", 0, "Version: 4.2\n", 1, "Error: no ptrace\n")
    assert not bad.usable and bad.reason == "'c check' failed: Error: no ptrace"
    assert judge("c", 0, "Version: 4.2\n", 0, "Looks good.").usable


def test_command_lines_lock_tcp_and_restore_as_our_child() -> None:
    d = dump_argv("criu", 42, "/s/r0", leave_running=True)
    assert d[:5] == ["criu", "dump", "-t", "42", "-D"] and "--tcp-established" in d and d[-1] == "--leave-running"
    assert "--network-lock" in d and d[d.index("--network-lock") + 1] == "skip"     # the job's own lock
    r = restore_argv("criu", "/s/r0", "/s/r0/pid", [(7, "pipe:[99]")])
    assert "--restore-sibling" in r and "--restore-detached" in r and r[-2:] == ["--inherit-fd", "fd[7]:pipe:[99]"]


def test_snapshot_due() -> None:
    assert not snapshot_due(5.0, None, 0.0, 10.0) and snapshot_due(10.0, None, 0.0, 10.0)
    assert not snapshot_due(15.0, 10.0, 0.0, 10.0) and snapshot_due(20.0, 10.0, 0.0, 10.0)
    assert not snapshot_due(1e9, None, 0.0, 0.0)


def test_death_and_taint_decisions() -> None:
    assert on_death(1, False, {0: 0, 1: 1}).move is Move.FALLBACK
    d = on_death(1, True, {0: 0, 1: 1})
    assert d.move is Move.RESTORE and d.slots == {0: 0, 1: 1}
    t = on_taint(1, {0: 0, 1: 1}, [4, 5])
    assert t.move is Move.MIGRATE and t.slots == {0: 0, 1: 4}
    assert on_taint(1, {0: 0, 1: 1}, []).move is Move.FALLBACK
    assert on_taint(7, {0: 0}, [4]).move is Move.FALLBACK


def test_probe_refuses_what_is_not_a_usable_criu(tmp_path) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Version: 3.17' && exit 0\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    got = asyncio.run(probe({E.TPASSRUN_CRIU: str(fake)}))
    assert not got.usable and "is CRIU 3.17" in got.reason
    got = asyncio.run(probe({E.TPASSRUN_CRIU: "/bin/false"}))
    assert not got.usable and "--version failed" in got.reason
    got = asyncio.run(probe({E.TPASSRUN_CRIU: os.path.join(str(tmp_path), "absent")}))
    assert not got.usable and "cannot be run" in got.reason


def test_flag() -> None:
    assert parse_args(["--standalone", "x.py"]).snapshot_interval == 0.0
    assert parse_args(["--standalone", "--snapshot-interval", "2.5", "x.py"]).snapshot_interval == 2.5
    with pytest.raises(ConfigError, match="--snapshot-interval must be"):
        parse_args(["--standalone", "--snapshot-interval", "-1", "x.py"])


def test_the_jobs_network_lock_drops_its_ports_both_ways() -> None:
    from tpassrun.snapshot import lock_ruleset

    text = lock_ruleset("t1", [5, 3, 5])
    assert text.startswith("table inet t1 {") and "elements = { 3, 5 }" in text
    assert text.count("tcp sport @ports drop") == 2 and text.count("tcp dport @ports drop") == 2
    assert "hook input" in text and "hook output" in text
    assert judge("c", 0, "Version: 4.2\n", 0, "Looks good.", nft=None).reason == \
        "the nft command (nftables) is not installed"
