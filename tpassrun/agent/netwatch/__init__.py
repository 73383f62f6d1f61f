"""Network faults: link flaps ridden out and said, degraded links found and turned into planned migrations.

The one door of the package. ``_plan`` is pure (figures in, verdicts out), ``_probe`` reads what the kernel knows
(no packet sent), ``_daemon`` is the agent's loop that joins them and acts. See docs/network.md.
"""

from tpassrun.agent.netwatch._daemon import READINGS_DEVICE, LinkDaemon, figures_of
from tpassrun.agent.netwatch._plan import (DEGRADED, HEALTHY, SUSPECT, UNKNOWN, Flap, FlapBook, LinkFigures, LinkVerdict,
                                           LinkWatch, flap_line)

__all__ = ["DEGRADED", "HEALTHY", "READINGS_DEVICE", "SUSPECT", "UNKNOWN", "Flap", "FlapBook", "LinkDaemon",
           "LinkFigures", "LinkVerdict", "LinkWatch", "figures_of", "flap_line"]
