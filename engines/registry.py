"""Build the adapter, or launch the server, for an engine config by its ``kind``; imported lazily."""

from __future__ import annotations

import httpx

from .base import EngineAdapter
from .config import AnyEngineConfig
from .processes import Launched, LaunchOptions

__all__ = ["build_adapter", "launch_engine"]


def build_adapter(config: AnyEngineConfig, client: httpx.AsyncClient) -> EngineAdapter:
    """The reference engine speaks SGLang's protocol, so both use the SGLang adapter."""
    if config.url is None:
        # Never the string "None": a launched engine gets its URL from the port colocd chose.
        raise ValueError(f"engine {config.name!r}: no 'url' to attach to (a launched engine gets one when "
                         "colocd starts it)")
    if config.kind == "reference" or config.kind == "sglang":
        from .sglang.adapter import SGLangAdapter

        return SGLangAdapter(config, client)
    if config.kind == "vllm":
        from .vllm.adapter import VLLMAdapter

        return VLLMAdapter(config, client)
    raise ValueError(f"engine {config.name!r}: unknown kind {config.kind!r}")


async def launch_engine(config: AnyEngineConfig, options: LaunchOptions | None = None) -> Launched:
    """Start ``config``'s server and return once it is ready (``options.on_spawn`` is told the process as soon as
    it exists); ``EngineLaunchError`` names the engine."""
    if config.kind == "reference":
        from .reference.launcher import launch_reference

        return await launch_reference(config, options or LaunchOptions())
    if config.kind == "sglang":
        from .sglang.launcher import launch_sglang

        return await launch_sglang(config, options)
    if config.kind == "vllm":
        from .vllm.launcher import launch_vllm

        return await launch_vllm(config, options)
    raise ValueError(f"engine {config.name!r}: unknown kind {config.kind!r}")
