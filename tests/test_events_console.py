"""The event log survives a full disk and broken listeners; the console describer is a pure function."""

from __future__ import annotations

import io
import re

from tpassrun.ops.console import ConsoleReporter, Describer, RunTally, summary_lines
from tpassrun.ops.events import EventLog, read_events
from tpassrun.ops.tally import RestartCost


def test_a_full_disk_is_reported_once_and_the_events_go_on(capsys):
    seen = []
    ev = EventLog("/dev/full", node_id="n").open()       # every write fails with ENOSPC
    ev.add_listener(seen.append)
    for i in range(3):
        ev.write("swap_phase", swap_id="s", phase="transfer", i=i)
    ev.close()
    err = capsys.readouterr().err
    assert err.count("cannot write the event log /dev/full") == 1 and "No space left" in err
    assert [e["i"] for e in seen] == [0, 1, 2] and ev.write_error


def test_a_failing_listener_never_raises_into_the_agent(caplog):
    def broken(_record):
        raise RuntimeError("boom")

    seen = []
    ev = EventLog(None, echo=broken)
    ev.add_listener(seen.append)
    ev.write("a")
    ev.write("b")
    assert [e["event"] for e in seen] == ["a", "b"]
    assert sum("boom" in r.getMessage() for r in caplog.records) == 1


def test_a_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"event": "a"}\n{"event": "b", "ti')
    assert [e["event"] for e in read_events(str(p))] == ["a"]


def _ev(name, mono, **kw):
    return {"event": name, "time": 1700000000.0 + mono, "mono": mono, "node": "host1-123-abcd", **kw}


def test_phases_have_durations_and_the_summary_adds_up():
    d = Describer()
    d.describe(_ev("agent_started", 0.0, endpoint="e:1", run_id="r", nproc=2, spares=1))
    assert d.describe(_ev("worker_died", 10.0, rank=1, step=7, code=-9, why="killed by SIGKILL")).startswith("[rank 1]")
    assert "pausing" in d.describe(_ev("swap_pause", 10.1, swap_id="u1", kind="unplanned", rank=1, boundary=None))
    line = d.describe(_ev("swap_phase", 10.3, swap_id="u1", phase="transfer", reason="stopped at step 7"))
    assert line == "[rank 1] recovery u1: transfer (pause took 200 ms): stopped at step 7"
    assert d.describe(_ev("swap_transfer", 10.31, swap_id="u1", kind="unplanned", rank=1, boundary=7)) is None
    d.describe(_ev("swap_transfer_end", 10.4, swap_id="u1", nbytes=2 * 1024 * 1024, seconds=0.05, checksum="c"))
    line = d.describe(_ev("swap_resumed", 10.6, swap_id="u1", rank=1, seconds=0.5))
    assert line == "[rank 1] recovered and resumed (swap u1): paused 500 ms, 2.0 MiB moved, 0 steps lost, 1 redone"
    d.describe(_ev("generation_ended", 20.0, generation=0, outcome="failed", reason="x"))
    d.describe(_ev("generation_joined", 24.0, generation=1, world_size=2, members=["host1-123-abcd"]))
    d.describe(_ev("training_resumed", 25.0, step=7, reached=7, redone=0, redone_s=0.0))   # the worker API says
    d.describe(_ev("agent_exit", 100.0, code=0))
    t = d.tally
    assert (t.wall, round(t.lost, 3), t.steps_redone) == (100.0, 5.5, 1)
    lines = summary_lines(t, 0)
    assert lines[1] == "summary: 0 swap(s), 1 recover(ies) (pause 500 ms), 1 whole-group restart(s), 0 hang kill(s)"
    assert lines[2] == "summary: time lost to failures 5.50 s, steps lost 0, steps redone 1, goodput 94.5%"


def test_the_leaders_reason_is_said_when_this_nodes_part_was_written_first():
    """CI, stop 21: the participant's own ``swap_transfer`` reached the console before the leader's ``swap_phase``;
    the phase was said once without the leader's reason ("mixed commit: ranks [0] ..."), so the log never said why
    rank 0 caught up. The reason now follows on its own line; a reason is never said twice."""
    d = Describer()
    d.describe(_ev("swap_pause", 10.1, swap_id="u1", kind="unplanned", rank=1, boundary=None))
    assert d.describe(_ev("swap_transfer", 10.2, swap_id="u1", kind="unplanned", rank=1, boundary=7)) == \
        "[rank 1] recovery u1: transfer (pause took 100 ms)"
    assert d.describe(_ev("swap_phase", 10.21, swap_id="u1", phase="transfer", reason="mixed commit: ranks [0]")) == \
        "[rank 1] recovery u1: transfer: mixed commit: ranks [0]"
    assert d.describe(_ev("swap_phase", 10.22, swap_id="u1", phase="transfer", reason="mixed commit: ranks [0]")) is None


def test_health_verdicts_only_when_they_change():
    d = Describer()
    assert d.describe(_ev("health_verdict", 1, device=0, status="healthy")) is None
    assert d.describe(_ev("health_verdict", 2, device=0, status="degraded", reason="ecc")) == \
        "health: device 0: healthy -> degraded (ecc)"
    assert d.describe(_ev("health_verdict", 3, device=0, status="degraded", reason="ecc")) is None


def test_the_console_line_has_torchruns_prefix_and_the_node_and_rank():
    out = io.StringIO()
    rep = ConsoleReporter(stream=out, pid=42)
    rep(_ev("hang_detected", 1.0, rank=3, pid=9, seconds=4.2, step=11, proc_state="T"))
    line = out.getvalue()
    assert line.startswith("W") and " 42 tpassrun/agent] [node host1] [rank 3] hang: no step for 4.20 s" in line
    assert RunTally().goodput == 100.0


def test_node_loss_lines_say_who_was_broken_out_caught_up_and_recovered():
    d = Describer()
    assert d.describe(_ev("collectives_broken", 1.0, swap_id="n-b", lost_node="host2-1-ab", ranks=[0, 1])) == \
        "node host2 lost: ranks [0, 1] broken out of their collectives (swap n-b)"
    assert d.describe(_ev("rank_caught_up", 1.1, swap_id="n-b", rank=1, step=13, donor=0, nbytes=2048)) == \
        "[rank 1] mixed commit: caught up to step 13 from rank 0 (swap n-b, 2.0 KiB)"
    line = d.describe(_ev("node_recovered", 1.5, swap_id="n-b", lost_node="host2-1-ab", also=["host4-2-cd"],
                          ranks=[1, 3], to=["host3-5-ef"], boundary=13, seconds=0.5))
    assert line.startswith("node host2, host4 lost: ranks [1, 3] recovered live on host3 at step 13")


def test_a_spare_node_joining_is_said_and_a_lost_node_coming_back_as_one_too():
    d = Describer()
    assert d.describe(_ev("spare_node_joined", 1.0, joined="host5-7-ab")) == \
        "spare node host5 joined (its slots serve the next failure)"
    assert d.describe(_ev("node_lost", 2.0, lost_node="host2-1-ab")) == "node host2 lost"
    assert d.describe(_ev("spare_node_joined", 9.0, joined="host2-1-ab")).startswith(
        "node host2, lost earlier, is back as a spare node")


def test_a_fenced_node_back_as_a_spare_node_counts_no_whole_group_restart():
    d = Describer()
    d.describe(_ev("agent_started", 0.0, node="host1-1-ab", endpoint="e:1", run_id="r", nproc=2, spares=0))
    d.describe(_ev("generation_joined", 1.0, node="host1-1-ab", generation=0, world_size=4,
                   members=["host1-1-ab", "host2-2-cd"]))
    d.describe(_ev("generation_ended", 9.0, node="host1-1-ab", generation=0, outcome="membership",
                   reason="fenced: no etcd lease refresh acknowledged in time"))
    d.describe(_ev("generation_joined", 20.0, node="host1-1-ab", generation=1, world_size=4,
                   members=["host3-3-ef", "host2-2-cd"]))
    assert d.tally.restarts == []


def test_a_full_disk_that_frees_gets_the_event_log_back_said_once_with_the_gap(tmp_path, capsys):
    """The chaos harness's disk_full fault frees the disk again; the event log (and the workers' tee copies,
    below) gave up for good at the first ENOSPC and stayed empty for the rest of the run. Now the file is tried
    again every RETRY_S, a gap record says how many events it missed, and stderr says each change once."""
    from tpassrun.ops import events

    now = [0.0]
    path = tmp_path / "e.jsonl"
    ev = EventLog(str(path), node_id="n", clock=lambda: now[0]).open()
    ev.write("a")
    ev._fh.close()
    ev._fh = open("/dev/full", "w", buffering=1)           # the disk fills up
    for i in range(3):
        ev.write("lost", i=i)
        now[0] += 1.0
    assert ev.write_error and "No space left" in ev.write_error
    now[0] += events.RETRY_S
    ev.write("b")
    ev.write("c")
    ev.close()
    got = [(e["event"], e.get("dropped")) for e in read_events(str(path))]
    assert got == [("a", None), ("event_log_gap", 3), ("b", None), ("c", None)], got
    err = capsys.readouterr().err
    assert err.count("cannot write the event log") == 1 and err.count("is written again (3 event(s) dropped") == 1
    assert ev.write_error is None


def test_a_tee_copy_that_failed_writes_again_once_the_disk_frees(caplog):
    import io

    from tpassrun.launch import procs

    class Disk(io.BytesIO):
        full = False
        name = "stdout.log"

        def write(self, data):
            if self.full:
                raise OSError(28, "No space left on device")
            return super().write(data)

    now = [0.0]
    disk = Disk()
    copier = procs._StreamCopier(disk, None, b"", None, (), clock=lambda: now[0])
    copier.feed(b"one\n")
    disk.full = True
    for _ in range(50):                                   # a chatty worker while the disk is full: said once
        copier.feed(b"lost\n")
        now[0] += 0.5
    disk.full = False
    now[0] += procs.RETRY_BROKEN_COPY_S
    copier.feed(b"two\n")
    assert disk.getvalue() == b"one\ntwo\n"
    said = [r.getMessage() for r in caplog.records if "worker's output" in r.getMessage()]
    assert len(said) == 2 and "cannot write" in said[0] and "again (" in said[1] and "bytes dropped" in said[1], said


def test_a_restart_counts_its_start_up_and_the_steps_it_runs_again_and_a_failed_run_no_goodput():
    """A whole-group restart used to be summed as 'steps lost 0, goodput 100.0%' although the new workers ran
    again every step since the script's last checkpoint (22 steps and ~30 s of start-up in the issue's run)."""
    d = Describer()
    d.describe(_ev("agent_started", 0.0, endpoint="e:1", run_id="r", nproc=2, spares=0))
    d.describe(_ev("generation_ended", 40.0, generation=0, outcome="failed", reason="x", step=22))
    d.describe(_ev("generation_joined", 42.0, generation=1, world_size=2, members=["host1-123-abcd"]))
    line = d.describe(_ev("training_resumed", 50.0, step=0, reached=22, redone=22, redone_s=11.0))
    assert line == ("training resumed at step 0 after the whole-group restart (it took 10.00 s from the failure): "
                    "22 step(s) run again (reached step 22 before; ~11.00 s)")
    d.describe(_ev("agent_exit", 100.0, code=0))
    t = d.tally
    assert t.restarts == [RestartCost("x", 10.0, 22, 11.0, 0)] and round(t.lost, 3) == 21.0 and t.restart_redone == 22
    assert summary_lines(t, 0)[2] == "summary: time lost to failures 21.00 s, steps lost 22, steps redone 0, goodput 79.0%"
    failed = summary_lines(t, 1)[2]
    assert "goodput not counted: the run failed" in failed and "%" not in failed


def test_progress_says_once_where_a_restarted_group_resumed_and_what_it_runs_again():
    from tpassrun.ops.progress import Progress, RankPosition

    p = Progress()
    p.started(after_restart=False)
    assert p.note([RankPosition(step=s, running=True, last_step_ms=500.0) for s in (20, 21)]) is None
    assert p.note([RankPosition(step=22, running=False)]) is None and p.high == 21
    p.started(after_restart=True)
    assert p.note([RankPosition(step=0, running=False)]) is None          # starting: nothing yet
    resumed = p.note([RankPosition(step=5, running=True), RankPosition(step=6, running=True)])
    assert (resumed.step, resumed.reached, resumed.redone, resumed.redone_s) == (5, 21, 16, 8.0)
    assert p.note([RankPosition(step=7, running=True)]) is None           # said once
    p.started(after_restart=True)
    assert p.note([RankPosition(step=30, running=True)]).redone == 0      # resumed past it (a checkpoint): none
    p.started(after_restart=True)    # seen late (the status loop runs once a second): where run() started counts
    assert p.note([RankPosition(step=9, running=True, run_from=0)]).step == 0


def test_the_launchers_python_log_lines_share_the_consoles_format():
    """The launcher's own warnings ('[2026-11-28 19:06:23,439] tpassrun.launch.workerenv WARNING: ...') used a second
    format beside the event lines; both are torchrun's glog-style lines now."""
    import logging

    from tpassrun.ops.console import GlogFormatter

    rec = logging.LogRecord("tpassrun.mirror", logging.WARNING, __file__, 1, "buddy %s unreachable", ("n2",), None)
    line = GlogFormatter().format(rec)
    assert line.startswith("W") and line.endswith(" tpassrun/mirror] buddy n2 unreachable"), line
    assert re.match(r"^W\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ tpassrun/mirror\] ", line), line


def test_a_survivors_exception_says_whose_fault_it_was():
    d = Describer()
    error = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer. " + "x" * 200
    line = d.describe(_ev("exception_cause", 1.0, rank=2, step=4, cause="casualty", error=error, seconds=0.05,
                          why="a casualty of rank 1's death (killed by SIGKILL)"))
    assert line == ("[rank 2] step 4 raised RuntimeError: a casualty of rank 1's death (killed by SIGKILL) (judged in "
                    "0.05 s); it waits for the recovery"), line      # gloo's text stays in the worker's log file
    line = d.describe(_ev("exception_cause", 2.0, rank=1, step=3, cause="root_cause", seconds=3.0,
                          error="ValueError: bad batch", why="no other rank failed within 3 s of it: the script's own error"))
    assert line == ("[rank 1] step 3 raised ValueError: bad batch: no other rank failed within 3 s of it: the script's "
                    "own error (judged in 3.0 s); following torchrun's path")


def test_a_survivors_failed_collective_says_what_interrupted_it_not_gloos_text():
    """Each survivor printed gloo's 3-line "Read error ... Connection reset by peer ... GLHF!" around tpassrun's
    own recovery lines (issue 28). Its text goes to the worker's log file; the agent's line says why."""
    d = Describer()
    gloo = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4937: "
            "Connection reset by peer. This is typically caused by a remote worker hanging. GLHF! \U0001f3d6")
    ev = _ev("step_interrupted", 1.0, rank=3, step=5, by="rank 1's death (killed by SIGKILL)", error=gloo,
             error_type="builtins.RuntimeError", failure="collective", log="/tmp/x/attempt_0/3/tpassrun.log")
    assert d.describe(ev) == "[rank 3] step 5 interrupted by rank 1's death (killed by SIGKILL); waiting for recovery"
    ev = _ev("step_interrupted", 2.0, rank=3, step=5, by="", error=gloo, error_type="builtins.RuntimeError")
    assert d.describe(ev) == "[rank 3] step 5 interrupted: its collective failed (RuntimeError); waiting for recovery"


def test_a_survivors_gloo_text_goes_to_its_stderr_log_under_redirects_else_beside_its_error_file(tmp_path):
    from tpassrun.channel import DETAIL_LOG, worker_log_file
    from tpassrun.plan.failkind import Around, interrupted_by

    err = str(tmp_path / "error.json")
    assert worker_log_file("") is None                                    # --log-dir /dev/null: no file at all
    assert worker_log_file(err) == str(tmp_path / DETAIL_LOG)             # stderr is the console's
    (tmp_path / "stderr.log").write_text("")                              # -r/-t gave stderr its log file
    assert worker_log_file(err) == str(tmp_path / "stderr.log")
    assert interrupted_by(Around(waited_s=0.1, dead=("rank 1's death (killed by SIGKILL)",))).startswith("rank 1's")
    assert interrupted_by(Around(waited_s=0.1, lost_nodes=("n2",))) == "node n2 lost"
    assert interrupted_by(Around(waited_s=0.1, failed_peers=(2,))) == ""   # a peer failing too is no cause


def test_nodes_on_one_host_are_told_apart_in_every_line():
    """On one machine every node was called ``vm`` (``node vm lost``, ``recovered live on vm``): once a second node
    of the run shares a host, each is named ``host-pid``, in the line and in its ``[node ...]`` prefix."""
    out = io.StringIO()
    rep = ConsoleReporter(stream=out, pid=42)
    rep({**_ev("agent_started", 0.0, endpoint="e:1", run_id="r", nproc=2, spares=0), "node": "vm-11-aaaa"})
    rep({**_ev("generation_joined", 1.0, generation=0, world_size=4, members=["vm-11-aaaa", "vm-22-bbbb"]),
         "node": "vm-11-aaaa"})
    rep({**_ev("node_recovered", 9.0, swap_id="n1", lost_node="vm-22-bbbb", ranks=[2, 3], to=["vm-33-cccc"],
               boundary=7, seconds=1.5), "node": "vm-11-aaaa"})
    lines = out.getvalue().splitlines()
    assert "[node vm] run r at etcd e:1" in lines[0]          # alone on its host so far: its host name
    assert "[node vm-11] generation 0 formed: world size 4, 2 node(s): vm-11, vm-22" in lines[1]
    assert ("[node vm-11] node vm-22 lost: ranks [2, 3] recovered live on vm-33 at step 7 (swap n1): paused 1.50 s"
            in lines[2])
