"""colocd's vLLM engine: the HTTP adapter, the server launcher (``launcher.launch_vllm``), and the in-worker
extension.

Names load lazily so that vLLM's worker can import ``colocd.engines.vllm.extension`` without
pulling in httpx or pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapter import VLLMAdapter

__all__ = ["EXTENSION_CLS", "VLLMAdapter"]

EXTENSION_CLS = "colocd.engines.vllm.extension.ColocdWorkerExtension"  # --worker-extension-cls


def __getattr__(name: str) -> Any:
    if name == "VLLMAdapter":
        from .adapter import VLLMAdapter

        return VLLMAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
