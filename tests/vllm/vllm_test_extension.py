"""Test-only worker extension: ColocdWorkerExtension plus a per-step delay, loaded by the test server.

On this 2-core CI machine the tiny model decodes ~500 tokens/s, faster than vLLM's API server can
stream them, so a /pause can land after the request it was meant to catch has finished. A sleep
before each model step slows the engine, not the frontend, so a pause reliably finds the request
in flight. vLLM's pause logic lives in the scheduler and does not depend on how long a step takes.
Imported inside the vLLM worker (the test server puts this directory on PYTHONPATH).
"""

from __future__ import annotations

import time
from typing import Any

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
