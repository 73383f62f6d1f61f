"""``--event-log-handler console``: torchelastic's JSON events on stderr, as torchrun prints them.

torchrun records ``torch.distributed.elastic.events.Event`` objects (``{"name", "source", "timestamp",
"metadata"}``) through a logger whose handler the flag picks; ``console`` is a bare ``StreamHandler`` (stderr,
the message only). The agent records RENDEZVOUS and ASSIGN_WORKER_RANKS (with their duration), a START per
worker, at the end one SUCCEEDED/FAILED/TERMINATED per worker, and the launcher SUCCEEDED or FAILED
(agent/server/api.py ``_construct_event``, launcher/api.py). ``null`` and ``dynamic_rendezvous`` print nothing.
It imports tpassrun only for role ranks, and only when enabled.
"""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import dataclass
from typing import IO, Any


@dataclass
class ElasticEvents:
    handler: str
    run_id: str
    role: str
    backend: str
    entry_point: str
    max_restarts: int
    stream: IO[str] | None = None

    @property
    def enabled(self) -> bool:
        return self.handler == "console"

    def agent(self, state: str, *, group_rank: int | None, group_world_size: int | None, remaining_restarts: int,
              duration_ms: float | None = None, raw_error: str | None = None, total_run_time: int = 0) -> None:
        md = {"group_world_size": group_world_size, "entry_point": self.entry_point}
        self._emit(state, "AGENT", md, None, None, group_rank, remaining_restarts, duration_ms, raw_error,
                   total_run_time)

    def worker(self, state: str, *, local_rank: int, rank: int, role_rank: int, role_world_size: int, pid: int | None,
               group_rank: int | None, group_world_size: int | None, remaining_restarts: int,
               exit_code: int | None = None, failed_pid: int | None = None, raw_error: str | None = None,
               total_run_time: int = 0) -> None:
        md = {"group_world_size": group_world_size, "entry_point": self.entry_point, "local_rank": [local_rank],
              "role_rank": [role_rank], "role_world_size": [role_world_size], "exit_code": [exit_code],
              "worker_pid": [failed_pid]}
        self._emit(state, "WORKER", md, rank, str(pid), group_rank, remaining_restarts, None, raw_error,
                   total_run_time)

    def _emit(self, state: str, source: str, md: dict[str, Any], rank: int | None, worker_id: str | None,
              group_rank: int | None, remaining_restarts: int, duration_ms: float | None, raw_error: str | None,
              total_run_time: int) -> None:
        if not self.enabled:
            return
        metadata = {
            "run_id": self.run_id, "global_rank": rank, "group_rank": group_rank, "worker_id": worker_id,
            "role": self.role, "hostname": socket.getfqdn(socket.gethostname()), "state": state,
            "total_run_time": total_run_time, "rdzv_backend": self.backend, "raw_error": raw_error,
            "metadata": json.dumps(md), "agent_restarts": self.max_restarts - remaining_restarts,
            "duration_ms": duration_ms,
        }
        event = {"name": f"torchelastic.worker.status.{state}", "source": source, "timestamp": 0,
                 "metadata": metadata}
        out = self.stream or sys.stderr
        out.write(json.dumps(event) + "\n")
        out.flush()

    # ---- what the agent calls (duck-typed: a Generation, the agent's slots, report.ProcessFailure) ----------

    def _where(self, gen: Any, node_id: str) -> tuple[int | None, int | None]:
        me = gen.member(node_id) if gen is not None else None
        return (me.group_rank if me is not None else None), (len(gen.members) if gen is not None else None)

    def rendezvous_done(self, gen: Any, node_id: str, seconds: float, remaining_restarts: int) -> None:
        group_rank, group_world_size = self._where(gen, node_id)
        for state, ms in (("RENDEZVOUS", seconds * 1000.0), ("ASSIGN_WORKER_RANKS", 0.0)):
            self.agent(state, group_rank=group_rank, group_world_size=group_world_size,
                       remaining_restarts=remaining_restarts, duration_ms=ms)

    def workers(self, state: str, gen: Any, node_id: str, slots: Any, remaining_restarts: int, *,
                failures: Any = (), total_run_time: int = 0) -> None:
        """One event per worker of this node: ``state`` for all (START, SUCCEEDED), or with ``failures`` given,
        FAILED for the failed ones and TERMINATED for the rest (torchrun's ``_get_worker_state``)."""
        from tpassrun.launch.workerenv import role_ranks  # the one tpassrun import, only when enabled

        if not self.enabled or gen is None:
            return
        group_rank, group_world_size = self._where(gen, node_id)
        failed = {f.rank: f for f in failures}
        for s in sorted((s for s in slots if s.rank is not None and s.rank >= 0 and s.proc is not None),
                        key=lambda s: s.local_rank):
            f = failed.get(s.rank)
            role_rank, role_world_size = role_ranks(gen.members, s.rank, gen.world_size)
            st = state if not failures else ("FAILED" if f is not None else "TERMINATED")
            raw = json.dumps({"message": f.message}) if f is not None else None
            self.worker(st, local_rank=s.local_rank, rank=s.rank, role_rank=role_rank, role_world_size=role_world_size,
                        pid=s.proc.pid, group_rank=group_rank, group_world_size=group_world_size,
                        remaining_restarts=remaining_restarts, exit_code=f.exitcode if f is not None else None,
                        failed_pid=f.pid if f is not None else None, raw_error=raw, total_run_time=total_run_time)
