"""Build the adapter for an engine config by its ``kind``; engine modules are imported lazily."""

from __future__ import annotations

from typing import Any

import httpx

from .base import EngineAdapter

__all__ = ["build_adapter"]


def build_adapter(config: Any, client: httpx.AsyncClient) -> EngineAdapter:
    """The reference engine speaks SGLang's protocol, so both use the SGLang adapter."""
    if config.kind in ("reference", "sglang"):
        from .sglang.adapter import SGLangAdapter

        return SGLangAdapter(config, client)
    if config.kind == "vllm":
        from .vllm import VLLMAdapter  # type: ignore[import-not-found]

        return VLLMAdapter(config, client)  # type: ignore[no-any-return]
    raise ValueError(f"engine {config.name!r}: unknown kind {config.kind!r}")
