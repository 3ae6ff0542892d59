"""The node's own series, bound to one daemon: every event counter declared at 0 for the configured engines,
the phase it is in and since when, whether it is busy, and the open weight session's idle age.

``busy`` and the session gauges are read when the exposition renders (a render happens after each change and
at least once per health interval), so a scrape during a long transition still says the node is busy.
"""

from __future__ import annotations

import time
from typing import Protocol

from .config import NodeConfig
from .metrics import Metrics
from .states import NodePhase, NodeState
from .steps import PARTS
from .weights import WeightSession

__all__ = ["MetricsContext", "NodeMetrics"]


class _Sessions(Protocol):
    current: WeightSession | None
    def open_id(self) -> str | None: ...


class MetricsContext(Protocol):
    """What the node's series read of the daemon."""

    config: NodeConfig
    metrics: Metrics
    node: NodeState
    @property
    def busy(self) -> bool: ...
    @property
    def sessions(self) -> _Sessions: ...


class NodeMetrics:
    """``NodeMetrics(daemon)`` once, then ``refresh()`` with the other gauges (``Daemon.refresh_gauges``)."""

    def __init__(self, daemon: MetricsContext) -> None:
        self._d = daemon
        m = daemon.metrics
        engines = daemon.config.engines
        m.declare((e.name for e in engines), (e.name for e in engines if e.launch is not None), PARTS)
        m.node_busy.set_function(lambda: 1.0 if daemon.busy else 0.0)
        m.session_open.set_function(lambda: 1.0 if daemon.sessions.open_id() is not None else 0.0)
        m.session_idle.set_function(self._session_idle_s)
        self._node: NodeState | None = None

    def refresh(self) -> None:
        """The phase gauges; a new (step, phase) restarts the clock of ``colocd_node_phase_entered_...``."""
        node, m = self._d.node, self._d.metrics
        if node is self._node:  # NodeState is replaced, never edited, on every move
            return
        if self._node is None or (node.phase, node.step) != (self._node.phase, self._node.step):
            m.node_phase_entered.set(time.time())
        self._node = node
        for phase in NodePhase:
            m.node_phase.labels(phase.value).set(1 if node.phase is phase else 0)
        m.node_step.set(node.step)

    def _session_idle_s(self) -> float:
        sessions = self._d.sessions
        current = sessions.current
        return current.idle_for() if current is not None and sessions.open_id() is not None else 0.0
