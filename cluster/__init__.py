"""colocd.cluster: colocd beyond one node, on Ray (the ``colocd[ray]`` extra).

One daemon per node stays the unit; Ray does the rest:

* ``daemon_actor``: ``NodeDaemon``, a Ray actor pinned to its node that runs ``colocd serve``, which attaches
  to or launches the node's engines; detached by choice, otherwise torn down with the job.
* ``registry``: each node's daemon by node id, ``NodeDaemons`` (start them, hold them), ``daemon_urls``,
  ``daemon_for_this_node``.
* ``client``: ``ClusterClient``, which fans phase transitions and weight syncs out to every daemon and
  fails the step, naming node, engine and reason, when any node fails (needs no ray).
* ``trainer``: ``push_to_this_node`` for trainer ranks.
* ``local``: a multi-node Ray cluster on one machine (tests, the example, ``bench.fanout``).

Only ``client`` is imported here, so ``import colocd.cluster`` works without ray installed.
"""

from .client import ClusterClient, ClusterStepError, NodeFailure, NodeResult, StepResult

__all__ = ["ClusterClient", "ClusterStepError", "NodeFailure", "NodeResult", "StepResult"]
