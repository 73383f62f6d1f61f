"""Terminal control sequences in anyone's text (a taint reason, a node id, a script argument) are shown escaped
at every sink that writes to a terminal, never interpreted (issue 27: a taint reason's escape sequences reached
the terminal raw through ``tpassctl status`` and the agent console)."""

from __future__ import annotations

import io
import json
import logging

import pytest
from rich.console import Console
from test_ctl import formed_run  # noqa: F401  (the fixture: a formed 2-node run in etcd)

from tpassrun.ops.cleantext import clean, clean_tree
from tpassrun.ops.console import GlogFormatter

# clears the screen, retitles the window, rings, rewrites the line, forges a second log line, reverses the text
EVIL = "GPU 1 \x1b[2J\x1b]0;pwned\x07\r\x9b31mE\x1b[0m\nI1123 forged line\u202egnp.exe\x00\x7f"
RAW = [chr(c) for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))] + ["\u202e", "\u2028"]


def assert_inert(out: str, *, lines: int | None = None) -> None:
    bad = sorted({repr(c) for c in out if c in RAW and c != "\n"})
    assert bad == [], f"raw control characters reach the terminal: {bad}\n{out!r}"
    if lines is not None:
        assert out.count("\n") == lines, out


def test_clean_escapes_every_control_character_and_keeps_text():
    assert clean(EVIL) == ("GPU 1 \\x1b[2J\\x1b]0;pwned\\x07\\r\\x9b31mE\\x1b[0m\\nI1123 forged line\\u202egnp.exe"
                           "\\x00\\x7f")
    for c in RAW:
        assert_inert(clean(c))
        assert "\n" not in clean(c)
    assert clean("tab\there, é ✓ 日本 [bold]x[/]") == "tab here, é ✓ 日本 [bold]x[/]"
    assert clean("two\nlines\x1b", block=True) == "two\nlines\\x1b"
    assert clean(42) == "42"
    assert clean_tree({"k\x1b": ["v\x07", 1, None, {"r": EVIL}], "n": 2.5}) == \
        {"k\\x1b": ["v\\x07", 1, None, {"r": clean(EVIL)}], "n": 2.5}


def test_the_agent_console_line_is_one_inert_line():
    from tpassrun.ops.console import ConsoleReporter

    out = io.StringIO()
    report = ConsoleReporter(stream=out, pid=7)
    report({"event": "agent_started", "mono": 1.0, "time": 1.0, "node": "n\x1b[31m-1-ab", "run_id": "r",
            "endpoint": "e", "nproc": 1, "spares": 0})
    report({"event": "health_taint", "mono": 2.0, "time": 2.0, "node": "vm-1-ab", "rank": 1, "slot": 1,
            "effect": "migrate", "source": "tpassctl\x1b]52;c;Zm9v\x07", "reason": EVIL})
    text = out.getvalue()
    assert_inert(text, lines=2)
    assert "\\x1b[2J" in text and "forged line" in text


def test_tpassctl_events_lines_are_inert(tmp_path):
    from tpassrun.ops.ctl_events import print_events
    from tpassrun.ops.registry import RunEntry

    log = tmp_path / "events.jsonl"
    log.write_text(json.dumps({"event": "fallback", "mono": 1.0, "time": 1.0, "node": "n\x1b[1m", "reason": EVIL})
                   + "\n")
    entry = RunEntry(run_id="r", endpoint="e", pid=0, event_log=str(log))
    for raw in (False, True):
        out = io.StringIO()
        assert print_events(entry, follow=False, raw=raw, out=out) == 0
        assert_inert(out.getvalue(), lines=1)


def test_the_live_view_and_its_summary_line_are_inert():
    from test_tui import run_doc, text, worker

    from tpassrun.ops.tui import ViewState, render_status, summary_line

    doc = run_doc(taints={"t\x1b1": {"v": 1, "id": "t1", "node_id": "n1", "slot": 1, "local_rank": 1, "rank": 3,
                                       "effect": "migrate", "reason": EVIL, "source": "tpassctl", "state": ""}},
                  closed={"v": 1, "reason": EVIL})
    doc["status"]["n1\x1b[2J"] = {"v": 1, "node_id": "n1\x1b[2J", "time": 0, "workers": [worker(0, 9, "running")]}
    out = text(doc)
    assert_inert(out)
    assert "\\x1b[2J" in out
    assert_inert(summary_line(doc))
    # drawn on a real terminal: rich's own styles are escape sequences; the document's are not among them
    console = Console(file=io.StringIO(), force_terminal=True, width=200, height=60, color_system="standard")
    console.print(render_status(doc, width=200, height=60, view=ViewState(node_filter="n\x1b[5m")))
    drawn = console.file.getvalue()
    assert "\x1b[2J" not in drawn and "\x1b]0;" not in drawn and "\x07" not in drawn and "\u202e" not in drawn


def test_tpassctl_status_table_and_taint_echo_are_inert(formed_run, capsys):  # noqa: F811  (the fixture)
    from test_ctl import ctl

    endpoint, run_id, _ = formed_run
    assert ctl(endpoint, run_id, "taint", "--rank", "1", "--reason", EVIL, "--no-wait") == 0
    assert_inert(capsys.readouterr().out, lines=1)
    assert ctl(endpoint, run_id, "status") == 0
    out = capsys.readouterr().out
    assert_inert(out)
    assert "\\x1b[2J" in out
    assert ctl(endpoint, run_id, "untaint", "--rank", "1") == 0


def test_the_agents_log_lines_are_inert_and_a_traceback_keeps_its_lines():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(GlogFormatter())
    log = logging.getLogger("tpassrun-test-clean")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("ignoring registration nodes/%s", "x\x1b[2J\ny")
        try:
            raise ValueError("bad \x1b]0;t\x07")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert_inert(text)
    assert text.splitlines()[0].endswith("tpassrun-test-clean] ignoring registration nodes/x\\x1b[2J\\ny")
    assert "Traceback (most recent call last):" in text and "ValueError: bad \\x1b]0;t\\x07" in text


def test_a_log_messages_own_lines_stay_lines():
    """torchrun's OMP_NUM_THREADS banner is a multi-line message of ours: it read as one line of literal \\n."""
    rec = logging.LogRecord("tpassrun.launch.workerenv", logging.WARNING, __file__, 1, "\n*****\nSetting %s\n*****",
                            ("OMP_NUM_THREADS\x1b[2J\nforged",), None)
    text = GlogFormatter().format(rec)
    assert text.splitlines()[1:] == ["*****", "Setting OMP_NUM_THREADS\\x1b[2J\\nforged", "*****"], text


@pytest.mark.parametrize("argv", [["--rdzv-backend", "etcd", "--rdzv-endpoint", "h\x1b[2J:1", "t.py"],
                                  ["--rdzv-id", "a/\x1b]0;t\x07", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                   "h:1", "t.py"]])
def test_a_rejected_command_line_is_echoed_inert(argv, capsys):
    from tpassrun.cli import main

    assert main(argv) == 1
    assert_inert(capsys.readouterr().err, lines=1)
