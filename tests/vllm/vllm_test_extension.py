"""Test-only worker extension: ColocdWorkerExtension plus a per-step delay, loaded by the test server.

On this 2-core CI machine the tiny model decodes ~500 tokens/s, faster than vLLM's API server can
stream them, so a /pause can land after the request it was meant to catch has finished. A sleep
before each model step slows the engine, not the frontend, so a pause reliably finds the request
in flight. vLLM's pause logic lives in the scheduler and does not depend on how long a step takes.
Imported inside the vLLM worker (the test server puts this directory on PYTHONPATH).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from colocd.engines.vllm.extension import ColocdWorkerExtension

__all__ = ["ThrottledColocdExtension"]


class ThrottledColocdExtension(ColocdWorkerExtension):
    def colocd_test_step_delay(self, delay_s: float) -> None:
        """Sleep ``delay_s`` before every execute_model; 0 restores full speed."""
        self.__dict__.pop("execute_model", None)
        if delay_s <= 0:
            return
        step = type(self).execute_model  # type: ignore[attr-defined]

        def slow_step(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay_s)
            return step(self, *args, **kwargs)

        self.execute_model = slow_step  # the worker busy loop looks methods up on the instance

    def colocd_test_parameter_checksums(self) -> dict[str, str]:
        """vLLM 0.32's /weight_checker checksums (model_loader/weight_checksum.py: sha256 of each parameter's bytes,
        keyed ``dp{i}:pp{j}:pcp{k}:tp{r}:<param>``), for releases without that route (0.29)."""
        import hashlib

        from vllm.distributed import get_tp_group

        prefix = f"dp0:pp0:pcp0:tp{get_tp_group().rank_in_group}:"
        return {prefix + name: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
                .hexdigest() for name, p in self.model_runner.get_model().named_parameters()}  # type: ignore[attr-defined]

    def colocd_test_cpu_isa(self) -> dict[str, Any]:
        """What this worker's kernel choices read: torch.cpu's AMX check (the shim's or torch's) and oneDNN's cap."""
        import torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        check = torch.cpu._is_amx_tile_supported
        return {"amx_check": f"{check.__module__}.{check.__qualname__}", "amx": check(),
                "attention_isa": _get_attn_isa(torch.bfloat16, 32),
                "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")}
