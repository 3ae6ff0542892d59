"""The reference engine's tensor-parallel ranks: each one a full copy of the model on its own device.

SGLang runs one scheduler process per TP rank, and each reads only its own entry of
``serialized_named_tensors``: the full HF tensors, which its ``load_weights`` then shards
(research/engine-apis.md §1.7). The reference engine keeps its ranks in one process and does not
shard: every rank holds the full tensors its own entry carries. A chunk whose entries disagree is
refused before any rank applies it, so the ranks always hold the same weights and generation may
run on rank 0's alone, while a rank that was never fed still shows in its own checksum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .memory import MemoryRegions
from .model import QwenLikeForCausalLM

__all__ = ["TPRank", "disagreement", "rank_checksum", "rank_devices"]

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(slots=True)
class TPRank:
    """One TP rank: its device, its weights and memory tags."""

    index: int
    device: torch.device
    model: QwenLikeForCausalLM
    memory: MemoryRegions


def rank_devices(device: str, tp_size: int) -> list[torch.device]:
    """Where each TP rank runs: ``cpu``, every rank on the CPU; ``cuda``, rank r on visible GPU r; ``cuda:N`` (one
    rank only), that GPU. Runs on the model thread (touches CUDA)."""
    if not device.startswith("cuda") or tp_size == 1:
        return [torch.device(device)] * tp_size
    if (visible := torch.cuda.device_count()) < tp_size:
        raise ValueError(f"tp_size {tp_size} needs one GPU per TP rank, but this process sees {visible}")
    return [torch.device("cuda", r) for r in range(tp_size)]


def disagreement(entries: Sequence[NamedTensors]) -> str | None:
    """Why the TP ranks' entries of one chunk do not carry the same full tensors; None when they do."""
    first, same = dict(entries[0]), "every TP rank's entry must carry the same full tensors"
    for r, named in enumerate(entries[1:], start=1):
        other = dict(named)
        if other.keys() != first.keys():
            missing, extra = sorted(first.keys() - other.keys()), sorted(other.keys() - first.keys())
            return f"TP rank {r}'s entry carries other tensors than rank 0's (missing {_some(missing)}, extra " \
                   f"{_some(extra)}); {same}"
        if differing := [n for n in sorted(first) if not _equal(first[n], other[n])]:
            return f"tensors {_some(differing)} differ between TP rank {r}'s entry and rank 0's; {same}"
    return None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))


def rank_checksum(rank: TPRank, tp_size: int, skip: tuple[str, ...]) -> dict[str, Any]:
    """One rank's ``ranks`` entry of SGLang's ``/weights_checker`` checksum reply."""
    named = [(n, p.detach()) for n, p in rank.model.named_parameters() if not any(s in n for s in skip)]
    # Per tensor: the first 16 hex digits of the sha256 of its bytes (SGLang prints a 64-bit hash).
    per_tensor = {n: hashlib.sha256(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                  .hexdigest()[:16] for n, t in named}
    overall = hashlib.sha256()
    for name in sorted(per_tensor):  # SGLang's overall_checksum (utils/weight_checker.py)
        overall.update(name.encode())
        overall.update(per_tensor[name].encode())
    parallelism = {"role": "target", "tp_rank": rank.index, "tp_size": tp_size, "dp_rank": 0, "dp_size": 1,
                   "pp_rank": 0, "pp_size": 1, "rank": rank.index, "size": tp_size}
    return {"checksums": per_tensor, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": [parallelism]}


def _some(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return f"[{shown}{more}]" if names else "none"
