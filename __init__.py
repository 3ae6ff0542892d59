"""colocd: a per-node daemon for colocated RL post-training.

The trainer posts phase transitions; the daemon drives every inference engine on the node
over its own HTTP API (pause, release and resume memory, stream weights) and reports what happened.
Layers: ``policies`` decide, ``engines`` act, ``daemon`` orchestrates, ``api`` exposes.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
