"""Rendezvous errors. Every message is one line a user can act on.

    RendezvousError                   base; also "no etcd binary", bad configuration
     +-- RendezvousClosedError        the run was closed (finished or failed); late joiners get this
     +-- RendezvousTimeoutError       join_timeout / wait_bootstrap timeout passed
     +-- RendezvousConnectionError    etcd unreachable at start, or an outage outlasted reconnect_timeout
     +-- RendezvousKeyError           the job's records carry another run key's seal (agents given different keys)
"""

from __future__ import annotations


class RendezvousError(Exception):
    """Base class of every error raised by ``tpassrun.rendezvous``."""


class RendezvousClosedError(RendezvousError):
    """The run is closed: no generation will ever form again."""


class RendezvousTimeoutError(RendezvousError):
    """A bounded wait (join, bootstrap) ran out of time."""


class RendezvousConnectionError(RendezvousError):
    """etcd could not be reached within the configured time."""


class RendezvousKeyError(RendezvousError):
    """This agent has not joined, and the job's own records (generation, leader) were sealed with another run key
    than this agent's (or with one while it has none): waiting for a join timeout would only hide that."""
