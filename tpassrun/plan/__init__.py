"""tpassrun.plan: pure decisions (no I/O, no clock): the leader's triage and its typed actions, the swap planner and
its phases, what a death is (failkind), giving spares back (giveback), resume steps, mixed commits and node plans.

The door: other packages import what they use of plan from here.
"""

from tpassrun.plan.actions import (
                                   Action,
                                   CasPlan,
                                   ClaimFromPool,
                                   CreatePlan,
                                   PutFailure,
                                   PutFallback,
                                   PutTaint,
                                   RestartGroup,
                                   Say,
                                   Seen,
)
from tpassrun.plan.failkind import CAUSE_GRACE_S, Around, Cause, cause_of, classify_death, interrupted_by, recoverable
from tpassrun.plan.giveback import GiveBack, MoveHome, plan_give_back, seen_ranks
from tpassrun.plan.swap import (
                                   PHASE_TIMEOUT_S,
                                   REPORT_DEADLINE_S,
                                   ClusterView,
                                   Decision,
                                   Phase,
                                   SlotRef,
                                   SlotView,
                                   SwapKind,
                                   of_attempt,
                                   transfer_key,
                                   world_prefix,
)
from tpassrun.plan.triage import triage

__all__ = ["Action", "Around", "CAUSE_GRACE_S", "CasPlan", "Cause", "ClaimFromPool", "ClusterView", "CreatePlan",
           "Decision", "GiveBack", "MoveHome", "PHASE_TIMEOUT_S", "Phase", "PutFailure", "PutFallback", "PutTaint",
           "REPORT_DEADLINE_S", "RestartGroup", "Say", "Seen", "SlotRef", "SlotView", "SwapKind", "cause_of",
           "classify_death", "interrupted_by", "of_attempt", "plan_give_back", "recoverable", "seen_ranks",
           "transfer_key", "triage", "world_prefix"]
