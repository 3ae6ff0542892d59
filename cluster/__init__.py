"""colocd.cluster: colocd beyond one node, on Ray (the ``colocd[ray]`` extra); one daemon per node stays the unit.
Only ``client`` (``ClusterClient``, needs no ray) is imported here; ``registry`` runs the daemons as Ray actors."""

from .client import ClusterClient, ClusterStepError, NodeFailure, NodeResult, StepResult

__all__ = ["ClusterClient", "ClusterStepError", "NodeFailure", "NodeResult", "StepResult"]
