"""Network faults: link flaps ridden out and said, degraded links found and turned into planned migrations.

The one door of the package. ``_plan`` judges a node's link (pure: state, sample, now -> verdict), ``_explain``
finds whose link the figures of every node point at (pure), ``_flaps`` tells flaps from outages (pure),
``_setup`` checks the multi-host setup at start (pure), ``_probe`` reads what the kernel knows (no packet sent),
``_daemon`` is the agent's loop that joins them and acts. See docs/network.md.
"""

from tpassrun.agent.netwatch._daemon import READINGS_DEVICE, LinkDaemon, figures_of
from tpassrun.agent.netwatch._explain import Finding, NodeFigures, Window, explain
from tpassrun.agent.netwatch._flaps import Flap, FlapBook, flap_line
from tpassrun.agent.netwatch._plan import (
                                           AMBIGUOUS,
                                           DEGRADED,
                                           HEALTHY,
                                           SUSPECT,
                                           UNKNOWN,
                                           LinkFigures,
                                           LinkVerdict,
                                           LinkWatch,
                                           StepMeter,
)
from tpassrun.agent.netwatch._setup import advertised_check, loopback_warning

__all__ = ["AMBIGUOUS", "DEGRADED", "HEALTHY", "READINGS_DEVICE", "SUSPECT", "UNKNOWN", "Finding", "Flap", "FlapBook",
           "LinkDaemon", "LinkFigures", "LinkVerdict", "LinkWatch", "NodeFigures", "StepMeter", "Window", "explain", "figures_of",
           "advertised_check", "flap_line", "loopback_warning"]
