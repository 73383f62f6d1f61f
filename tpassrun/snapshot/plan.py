"""Pure decisions of the transparent mode: which CRIU to use and whether it is usable, the criu command lines, when
the next snapshot is due, and what a death or a taint of a rank turns into. No I/O here (the effects are
:mod:`tpassrun.snapshot.criu`).

Invariants:
* a snapshot is of the whole job or of nothing: every rank frozen before the first dump, none thawed before the
  last (a rank dumped after a peer resumed could hold bytes its peer's image would send again);
* a restore is of the whole job, from one snapshot: no rank runs from an image older than another's;
* anything this mode cannot do falls back to torchrun's whole-group restart, with one line saying why.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tpassrun.settings import envnames as E

# Where scripts/criu.sh installs CRIU >= 4.2 (looked at first; then $TPASSRUN_CRIU, then `criu` on PATH).
DEFAULT_CRIU = "/opt/tpassrun-criu/sbin/criu"
MIN_VERSION = (4, 2)
# Every worker of a transparent job gets it: torch's libuv TCPStore holds an io_uring descriptor CRIU cannot dump.
WORKER_ENV = {E.USE_LIBUV: "0"}


class Verdict(enum.StrEnum):
    USABLE = "usable"
    UNUSABLE = "unusable"


@dataclass(frozen=True)
class Availability:
    verdict: Verdict
    criu: str              # the binary judged
    version: str = ""
    reason: str = ""       # why not, in words that fit one console line

    @property
    def usable(self) -> bool:
        return self.verdict is Verdict.USABLE


def criu_candidates(environ: Mapping[str, str], which: str | None) -> list[str]:
    """The binaries to try, in order: ``$TPASSRUN_CRIU`` (the operator's word is final: nothing else is tried when
    it is set), the one scripts/criu.sh installs, the one on PATH (``which``)."""
    given = environ.get(E.TPASSRUN_CRIU, "").strip()
    if given:
        return [given]
    out = [DEFAULT_CRIU]
    if which and which != DEFAULT_CRIU:
        out.append(which)
    return out


def parse_version(text: str) -> tuple[int, ...] | None:
    """``criu --version``'s "Version: 4.2.1" -> (4, 2, 1); None when it says no version."""
    m = re.search(r"^Version:\s*(\d+(?:\.\d+)*)", text, re.MULTILINE)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def judge(criu: str, version_rc: int | None, version_out: str, check_rc: int | None, check_out: str,
          nft: str | None = "nft") -> Availability:
    """One binary's verdict from ``criu --version`` and ``criu check`` (rc None: it could not be started); ``nft``: the
    nftables command the job's network lock needs (None: not found)."""
    if nft is None:
        return Availability(Verdict.UNUSABLE, criu, reason="the nft command (nftables) is not installed")
    if version_rc is None:
        return Availability(Verdict.UNUSABLE, criu, reason=f"{criu} cannot be run")
    version = parse_version(version_out)
    if version_rc != 0 or version is None:
        return Availability(Verdict.UNUSABLE, criu, reason=f"{criu} --version failed: {_last(version_out)}")
    shown = ".".join(map(str, version))
    if version[:2] < MIN_VERSION:
        return Availability(Verdict.UNUSABLE, criu, shown, reason=(
            f"{criu} is CRIU {shown}; >= {'.'.join(map(str, MIN_VERSION))} is needed (bash scripts/criu.sh)"))
    if check_rc != 0:
        return Availability(Verdict.UNUSABLE, criu, shown, reason=f"'{criu} check' failed: {_last(check_out)}")
    return Availability(Verdict.USABLE, criu, shown)


def first_usable(verdicts: Sequence[Availability]) -> Availability:
    """The first usable binary, else the first one's reason (the one the operator would look at)."""
    for v in verdicts:
        if v.usable:
            return v
    return verdicts[0] if verdicts else Availability(Verdict.UNUSABLE, "criu", reason="no CRIU binary found")


def _last(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[:200]


# ------------------------------------------------------------------ command lines
# The network lock is the job's, not each criu's (``skip``): one nftables table that drops every packet of the job's
# TCP connections from before the first dump until after the last (and from before the first restore until after
# the last): a rank restored before its peer would otherwise send to a socket not there yet and get a reset.
COMMON = ("--tcp-established", "--network-lock", "skip")


def lock_ruleset(table: str, ports: Sequence[int]) -> str:
    """The nft script of the job's network lock: TCP packets from or to any of ``ports`` (the local ports of every
    rank's TCP sockets) dropped both ways, before the sockets see them (so no reset is sent either)."""
    elements = ", ".join(str(p) for p in sorted(set(ports)))
    rules = "meta l4proto tcp tcp sport @ports drop; meta l4proto tcp tcp dport @ports drop;"
    return (f"table inet {table} {{\n"
            f"  set ports {{ type inet_service; elements = {{ {elements} }} }}\n"
            f"  chain input {{ type filter hook input priority -150; policy accept; {rules} }}\n"
            f"  chain output {{ type filter hook output priority -150; policy accept; {rules} }}\n"
            f"}}\n")


def dump_argv(criu: str, pid: int, images: str, *, leave_running: bool) -> list[str]:
    """Dump the process tree rooted at ``pid`` (a rank's session leader, already stopped with its group)."""
    argv = [criu, "dump", "-t", str(pid), "-D", images, "-o", "dump.log", "-v2", *COMMON]
    if leave_running:
        argv.append("--leave-running")
    return argv


def restore_argv(criu: str, images: str, pidfile: str, inherit: Sequence[tuple[int, str]]) -> list[str]:
    """Restore one rank's tree as a child of the caller (``--restore-sibling``: the agent is its parent again, and
    waits for it), its stdout/stderr pipes replaced by ``inherit``'s (criu's fd, the dumped pipe's "pipe:[ino]")."""
    argv = [criu, "restore", "-D", images, "-o", "restore.log", "-v2", *COMMON, "--restore-detached",
            "--restore-sibling", "--pidfile", pidfile]
    for fd, what in inherit:
        argv += ["--inherit-fd", f"fd[{fd}]:{what}"]
    return argv


# ------------------------------------------------------------------ when and what
def snapshot_due(now: float, last: float | None, started: float, interval: float) -> bool:
    """Every ``interval`` seconds of running, counted from the last snapshot (or the workers' start)."""
    return interval > 0 and now - (last if last is not None else started) >= interval


class Move(enum.StrEnum):
    RESTORE = "restore"        # a death: every rank back to the last snapshot, same slots
    MIGRATE = "migrate"        # a taint: snapshot now, the tainted rank restored on the spare's slot
    FALLBACK = "fallback"      # torchrun's whole-group restart (the reason says why)


@dataclass(frozen=True)
class Decision:
    move: Move
    reason: str
    slots: Mapping[int, int] | None = None     # rank -> the slot its restored process takes


def on_death(rank: int, have_snapshot: bool, ranks_slots: Mapping[int, int]) -> Decision:
    """A rank's process died (any cause): the job comes back from the last whole-job snapshot, same slots."""
    if not have_snapshot:
        return Decision(Move.FALLBACK, f"rank {rank} died before the first snapshot was taken")
    return Decision(Move.RESTORE, f"rank {rank} died: every rank restored from the last snapshot",
                    dict(ranks_slots))


def on_taint(rank: int, ranks_slots: Mapping[int, int], free_spares: Sequence[int]) -> Decision:
    """A tainted rank: snapshot now and restore it on the first free spare slot; the others keep their slots."""
    if rank not in ranks_slots:
        return Decision(Move.FALLBACK, f"rank {rank} runs on no slot of this node")
    if not free_spares:
        return Decision(Move.FALLBACK, f"no free spare slot to move rank {rank} to")
    slots = dict(ranks_slots)
    slots[rank] = free_spares[0]
    return Decision(Move.MIGRATE, f"rank {rank} moves from slot {ranks_slots[rank]} to slot {free_spares[0]}",
                    slots)
