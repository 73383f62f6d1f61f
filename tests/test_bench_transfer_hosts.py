"""bench/transfer.py --serve / --to: the target parser and the key's sources. Pure, one process, no network.

The two-host run is lent once on a NIC machine: a typo in ``--to`` or a missing key must be one line there, not a
traceback after the state was built."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_transfer", ROOT / "bench" / "transfer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


@pytest.mark.parametrize("text, expected", [
    ("hostb", ("hostb", bench.SERVE_PORT)),
    ("10.77.0.2:4000", ("10.77.0.2", 4000)),
    ("[fe80::1]:29611", ("fe80::1", 29611)),
    ("[::1]", ("::1", bench.SERVE_PORT)),
    ("fe80::1", ("fe80::1", bench.SERVE_PORT)),
    (" node-7.example ", ("node-7.example", bench.SERVE_PORT)),
])
def test_targets_parse(text: str, expected: tuple[str, int]) -> None:
    assert bench.parse_target(text) == expected


@pytest.mark.parametrize("text", ["", ":4000", "hostb:", "hostb:http", "hostb:0", "hostb:65536", "[::1", "[::1]4000"])
def test_bad_targets_are_one_line(text: str) -> None:
    with pytest.raises(bench.BenchError) as caught:
        bench.parse_target(text)
    assert "\n" not in str(caught.value) and "--to" in str(caught.value)


def test_the_key_comes_from_a_file_or_the_environment_never_short(tmp_path: Path) -> None:
    key_file = tmp_path / "bench.key"
    key_file.write_bytes(b"0123456789abcdef-file\n")
    assert bench.read_key(str(key_file), {}) == b"0123456789abcdef-file"
    assert bench.read_key(None, {bench.KEY_ENV: "0123456789abcdef-env"}) == b"0123456789abcdef-env"
    assert bench.read_key(str(key_file), {bench.KEY_ENV: "0123456789abcdef-env"}) == b"0123456789abcdef-file"
    for key_file_arg, environ, says in [
        (None, {}, bench.KEY_ENV),
        (str(tmp_path / "missing.key"), {}, "missing.key"),
        (None, {bench.KEY_ENV: "short"}, "at least 16"),
    ]:
        with pytest.raises(bench.BenchError) as caught:
            bench.read_key(key_file_arg, environ)
        assert says in str(caught.value) and "\n" not in str(caught.value)
