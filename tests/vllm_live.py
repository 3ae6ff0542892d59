"""What the live vLLM tier (tests/vllm) asks of the server beside colocd's adapter: vLLM's own flags, its disk loader
and its checksums, and the digest colocd's worker extension keeps of what arrived. None of it is a verb the daemon
uses, so the tests speak vLLM's HTTP API for it directly.

Its own module (not tests/vllm/conftest.py) so test modules can import it by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from colocd.engines.digest import tensor_digests

# What differs between the tested releases, as the live tier checks it (docs/vllm.md "Tested against";
# research/engine-versions.md §A with file:line in each wheel): the routes a release lacks, and whether /sleep
# range-checks its level (0.29 parses it with a bare int(): ?level=5 is a 200).
LACKS: dict[str, frozenset[str]] = {
    "0.29.0": frozenset({"/release_kv_cache_memory"}),
    "0.32.0": frozenset(),
}
SLEEP_LEVEL_CHECKED = {"0.29.0": False, "0.32.0": True}


class VLLMHttp:
    """One vLLM server's routes, read and driven as the tests need; any reply but 200 raises."""

    def __init__(self, url: str, client: httpx.AsyncClient) -> None:
        self._url = url.rstrip("/")
        self._client = client

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        # Connection: close, as the adapter sends: a worker's error drops the keep-alive socket (docs/vllm.md).
        response = await self._client.request(method, self._url + path, headers={"Connection": "close"}, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None

    async def healthy(self) -> bool:
        """``GET /health`` answers 200 (it never generates, so it passes while asleep)."""
        return (await self._client.get(self._url + "/health")).status_code == 200

    async def is_sleeping(self) -> bool:
        """vLLM's own flag: true while any tag is asleep *or* the scheduler is merely paused."""
        return bool((await self._json("GET", "/is_sleeping"))["is_sleeping"])

    async def is_paused(self) -> bool:
        return bool((await self._json("GET", "/is_paused"))["is_paused"])

    async def weight_version(self) -> str | None:
        version = (await self._json("GET", "/weight_info"))["weight_version"]
        return None if version is None else str(version)

    async def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        body = {"method": method, **({"kwargs": kwargs} if kwargs else {})}
        reply = await self._json("POST", "/collective_rpc", json=body)
        return [] if reply is None else list(reply["results"])  # empty: every worker returned None

    async def received(self, named: Sequence[tuple[str, Any]]) -> bool:
        """Every worker received exactly ``named`` in the last update: the extension's digest of each tensor as
        it arrived (``colocd_received_digests``) is ``engines/digest.py``'s of the tensor sent."""
        expected = tensor_digests(named)
        replies = await self._rpc("colocd_received_digests", names=sorted(expected))
        return bool(replies) and all(r == expected for r in replies)

    async def reload_weights(self, weights_path: str, weight_version: str | None = None) -> None:
        """vLLM's own loader reads an HF checkpoint directory in place (and repoints its model path at it)."""
        await self._rpc("reload_weights", weights_path=weights_path)
        if weight_version is not None:
            await self._json("POST", "/update_weight_version", json={"new_version": weight_version})

    async def has_weight_checker(self) -> bool:
        """vLLM 0.32 has /weight_checker; 0.29 does not (research/engine-versions.md §A.1)."""
        paths = (await self._json("GET", "/openapi.json"))["paths"]
        return "/weight_checker" in paths

    async def checksums(self) -> dict[str, str]:
        """``/weight_checker`` checksum: vLLM's per-parameter digests of the served model, keyed
        ``dp{i}:pp{j}:pcp{k}:tp{r}:<param>`` (gpu_worker.py:367-378). On CPU the prepacked linear weights are
        empty tensors, so only embeddings, lm_head, norms and biases are covered. Where the route is absent (0.29),
        the test extension computes the same digests (vllm/vllm_test_extension.py)."""
        if not await self.has_weight_checker():
            merged: dict[str, str] = {}
            for worker in await self._rpc("colocd_test_parameter_checksums"):
                merged.update(worker)
            return merged
        return dict((await self._json("POST", "/weight_checker", json={"action": "checksum"}))["checksums"])

    async def mismatches(self, baseline: dict[str, str]) -> list[str]:
        """``/weight_checker`` compare: the parameters whose digest differs from ``baseline``."""
        if not await self.has_weight_checker():
            now = await self.checksums()
            return sorted(k for k in now.keys() | baseline.keys() if now.get(k) != baseline.get(k))
        reply = await self._json("POST", "/weight_checker", json={"action": "compare", "baseline": baseline})
        return list(reply["mismatches"])
