"""Pushing a LoRA adapter version through the daemon: one request carries its tensors and its PEFT config.

    from peft import get_peft_model_state_dict
    reply = await push_adapter(client, get_peft_model_state_dict(model).items(),
                               config=model.peft_config["default"].to_dict(), base="policy", version=str(step))
    # reply["adapter"] == "policy@<step>": the name rollouts request

The body is ``adapter_model.safetensors`` as PEFT saves it, with ``adapter_config.json`` in its metadata; the daemon
writes the folder the engines load. Host copies: nothing stays exported, so there is no IPC lease to report.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from safetensors.torch import save

from ..api.client import AsyncColocdClient

__all__ = ["adapter_body", "push_adapter"]

ADAPTER_CONFIG_KEY = "adapter_config"  # what daemon/adapters.py reads from the file's __metadata__


def _jsonable(value: object) -> object:
    # PEFT's configs hold sets (target_modules) and enums (task_type); save_pretrained writes them as lists/values.
    if isinstance(value, set | frozenset):
        return sorted(value)
    return getattr(value, "value", str(value))


def adapter_body(named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> bytes:
    """adapter_model.safetensors with the config in its ``adapter_config`` metadata (host copies of the tensors)."""
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named}
    return save(tensors, metadata={"format": "pt", ADAPTER_CONFIG_KEY: json.dumps(dict(config), default=_jsonable)})


async def push_adapter(client: AsyncColocdClient, named: Iterable[tuple[str, torch.Tensor]], *,
                       config: Mapping[str, Any], base: str, version: str) -> dict[str, Any]:
    """Push one adapter version; returns once every engine serves ``<base>@<version>`` (the reply's ``adapter``).
    The daemon refuses a reused name or a push over an engine's adapter cap (409), and an engine that serves no
    adapters (409 naming it); a failed push leaves the previous version serving."""
    body = await asyncio.to_thread(adapter_body, list(named), config)
    return await client.push_adapter(base, version, body)
