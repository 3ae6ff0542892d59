"""colocd.cluster: colocd beyond one node, on Ray (the ``colocd[ray]`` extra); one daemon per node stays the unit.

``registry``: ``NodeDaemon``, the Ray actor that runs each node's daemon, finding it (``NodeDaemons``,
``daemon_urls``, ``daemon_for_this_node``) and ``push_to_this_node`` for trainer ranks; ``client``:
``ClusterClient``, one step fanned out to every daemon (needs no ray). Only ``client`` is imported here, so
``import colocd.cluster`` works without ray installed.
"""

from .client import ClusterClient, ClusterStepError, NodeFailure, NodeResult, StepResult

__all__ = ["ClusterClient", "ClusterStepError", "NodeFailure", "NodeResult", "StepResult"]
