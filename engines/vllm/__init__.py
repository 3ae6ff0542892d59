"""colocd's vLLM engine: the HTTP adapter, the server launcher (``launcher.launch_vllm``), and the in-worker
extension.

Names load lazily so that vLLM's worker can import ``colocd.engines.vllm.extension`` without
pulling in httpx or pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import VLLMAdapter

__all__ = ["BACKEND_NAME", "VLLMAdapter"]

# The weight-transfer backend the extension registers in vLLM's workers; here, not in extension.py, so
# the launcher names it without importing torch.
BACKEND_NAME = "colocd"


def __getattr__(name: str) -> Any:
    if name == "VLLMAdapter":
        from .adapter import VLLMAdapter

        return VLLMAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
