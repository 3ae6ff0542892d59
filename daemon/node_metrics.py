"""The node's own series, bound to one daemon: every event counter declared at 0 for the configured engines,
the phase it is in and since when, whether it is busy, and the open weight session's idle age.

``busy`` and the session gauges are read when the exposition renders (a render happens after each change and
at least once per health interval), so a scrape during a long transition still says the node is busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ..engines.config import AnyEngineConfig
from .metrics import Metrics
from .states import NodePhase, NodeState
from .steps import PARTS
from .weights import WeightSession

__all__ = ["NodeMetrics"]


class _Sessions(Protocol):
    current: WeightSession | None
    def open_id(self) -> str | None: ...


class NodeMetrics:
    """Once per daemon, then ``refresh()`` with the other gauges (``Daemon.refresh_gauges``). ``state`` and ``busy``
    read the node as of now."""

    def __init__(self, metrics: Metrics, engines: Sequence[AnyEngineConfig], sessions: _Sessions, *,
                 state: Callable[[], NodeState], busy: Callable[[], bool]) -> None:
        self._metrics, self._sessions, self._state = metrics, sessions, state
        metrics.declare((e.name for e in engines), (e.name for e in engines if e.launch is not None), PARTS)
        metrics.node_busy.set_function(lambda: 1.0 if busy() else 0.0)
        metrics.session_open.set_function(lambda: 1.0 if sessions.open_id() is not None else 0.0)
        metrics.session_idle.set_function(self._session_idle_s)
        self._node: NodeState | None = None

    def refresh(self) -> None:
        """The phase gauges; a new (step, phase) restarts the clock of ``colocd_node_phase_entered_...``."""
        node, m = self._state(), self._metrics
        if node is self._node:  # NodeState is replaced, never edited, on every move
            return
        if self._node is None or (node.phase, node.step) != (self._node.phase, self._node.step):
            m.node_phase_entered.set(time.time())
        self._node = node
        for phase in NodePhase:
            m.node_phase.labels(phase.value).set(1 if node.phase is phase else 0)
        m.node_step.set(node.step)

    def _session_idle_s(self) -> float:
        sessions = self._sessions
        current = sessions.current
        return current.idle_for() if current is not None and sessions.open_id() is not None else 0.0
