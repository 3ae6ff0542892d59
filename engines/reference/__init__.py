"""The embedded reference engine: SGLang's HTTP protocol over a tiny torch causal LM, plus its launcher.

Only the launcher is re-exported here, so importing this package stays cheap (no torch); the
model, server and engine live in their own modules (``model``, ``server``, ``engine``...).
"""

from .launcher import ReferenceEngineProcess

__all__ = ["ReferenceEngineProcess"]
