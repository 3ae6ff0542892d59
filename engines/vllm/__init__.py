"""colocd's vLLM engine: the HTTP adapter (``adapter.VLLMAdapter``), the server launcher (``launcher.launch_vllm``),
and the in-worker extension. Imports nothing, so that vLLM's worker imports ``extension`` without httpx or pydantic.
"""

__all__ = ["EXTENSION_CLS"]

EXTENSION_CLS = "colocd.engines.vllm.extension.ColocdWorkerExtension"  # --worker-extension-cls
