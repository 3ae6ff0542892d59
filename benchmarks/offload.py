"""A training rank's GPU state and its offload to pinned host memory around a colocated rollout.

What one Megatron-style rank with a distributed optimizer holds for a dense checkpoint:

- ``weights``: the bf16 parameters, one allocation per HF tensor (what the weight sync reads);
- ``grads``: one flat bf16 gradient buffer (Megatron's DDP grad buffer), not preserved across a pause;
- ``optimizer``: this rank's shard of the fp32 master weights and Adam's two moments, three flat
  fp32 buffers over the parameters the shard owns (``1 / shards`` of them, whole tensors).

``offload(parts)`` copies the parts to pinned host buffers allocated once and reused (Relax's
selective offload; slime's pinned tensor backups), then drops the GPU storage; ``onload(parts)``
allocates again and copies back. Both wait for their copies and report seconds and bytes. The copies
run on the state's own CUDA stream (after the work already queued on the caller's stream), so an
offload in a worker thread overlaps the weight push and the phase calls instead of queueing behind
them or in front of them on the default stream. The caller runs cleanup (the cleanup policy)
afterwards: dropping a tensor returns it to torch's cache, not to the driver. ``step`` does real
optimizer work on the shard so every sync moves new bytes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["OffloadReport", "Part", "RankState"]

Part = str  # "weights" | "grads" | "optimizer"
PARTS: tuple[Part, ...] = ("weights", "grads", "optimizer")
COPY_PIECE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class OffloadReport:
    """One offload or onload: which parts, bytes copied over PCIe, bytes dropped or allocated, seconds."""

    parts: tuple[Part, ...]
    copied_bytes: int
    device_bytes: int
    seconds: float


class RankState:
    """bf16 weights, a flat bf16 grad buffer and an fp32 Adam shard, movable to and from pinned memory."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]], device: torch.device, *,
                 shards: int = 1, seed: int = 0, pin: bool = True) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.device = device
        self.names = [n for n, _ in shapes]
        self.shapes = [tuple(s) for _, s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        total = sum(self.numels)
        # This rank's optimizer shard: the leading whole tensors covering >= 1/shards of the parameters.
        owned, acc = 0, 0
        while owned < len(self.numels) and acc * shards < total:
            acc += self.numels[owned]
            owned += 1
        self.owned = max(owned, 1)
        self.shard_numel = sum(self.numels[: self.owned])
        self.param_numel = total
        self._pin = pin and device.type == "cuda"
        gen = torch.Generator(device=device).manual_seed(seed)
        self.weights: list[torch.Tensor] | None = [
            torch.empty(s, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
            for s in self.shapes
        ]
        self.grads: torch.Tensor | None = torch.zeros(total, dtype=torch.bfloat16, device=device)
        optim = torch.empty(3 * self.shard_numel, dtype=torch.float32, device=device)
        master, _, _ = optim.split(self.shard_numel)  # type: ignore[no-untyped-call]  # torch's split is untyped
        torch.cat([w.reshape(-1) for w in self.weights[: self.owned]], out=master)
        optim[self.shard_numel :].zero_()
        self.optimizer: torch.Tensor | None = optim
        # Pinned host mirrors, allocated on the first offload of each part and reused.
        self._host: dict[Part, torch.Tensor] = {}
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.steps = 0

    # --- sizes -------------------------------------------------------------------------------------

    def nbytes(self, part: Part) -> int:
        if part == "weights":
            return 2 * self.param_numel
        if part == "grads":
            return 2 * self.param_numel
        if part == "optimizer":
            return 4 * 3 * self.shard_numel
        raise ValueError(f"unknown part {part!r}; known: {PARTS}")

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        if self.weights is None:
            raise RuntimeError("weights are offloaded; onload them first")
        return list(zip(self.names, self.weights, strict=True))

    def resident(self, part: Part) -> bool:
        return getattr(self, _attr(part)) is not None

    # --- training work -----------------------------------------------------------------------------

    def step(self, tokens: int, *, lr: float = 1e-5, seed: int = 0,
             all_reduce: Callable[[torch.Tensor], object] | None = None) -> float:
        """One optimizer step: a real forward/backward of ``tokens`` tokens through the first layer's
        MLP (gate, up, down), random gradients for every other parameter (a full backward is model
        compute, not switch cost), then Adam on this rank's shard and the bf16 cast back. Returns
        the loss. ``all_reduce(tensor)``, if given, reduces the real gradients (the DP group's job).
        """
        if self.weights is None or self.grads is None or self.optimizer is None:
            raise RuntimeError("training needs weights, grads and optimizer on the device")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.grads.normal_(0.0, 1e-3, generator=gen)
        mlp = [self._index(f"layers.0.mlp.{p}_proj.weight") for p in ("gate", "up", "down")]
        loss = 0.0
        if None not in mlp:
            idx = [i for i in mlp if i is not None]
            gate, up, down = (self.weights[i].detach().requires_grad_() for i in idx)
            x = torch.randn(tokens, gate.shape[1], dtype=gate.dtype, device=self.device, generator=gen)
            out = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
            value = out.float().pow(2).mean()
            grads = torch.autograd.grad(value, [gate, up, down])
            for i, g in zip(idx, grads, strict=True):
                if all_reduce is not None:
                    all_reduce(g)
                self._grad_view(i).copy_(g)
            loss = float(value.detach())
        self._adam(lr)
        self.steps += 1
        return loss

    def _index(self, suffix: str) -> int | None:
        return next((i for i, n in enumerate(self.names) if n.endswith(suffix)), None)

    def _grad_view(self, i: int) -> torch.Tensor:
        assert self.grads is not None
        start = sum(self.numels[:i])
        return self.grads[start : start + self.numels[i]].view(self.shapes[i])

    def _adam(self, lr: float, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8) -> None:
        assert self.weights is not None and self.grads is not None and self.optimizer is not None
        master, m, v = self.optimizer.split(self.shard_numel)  # type: ignore[no-untyped-call]
        # Groups of tensors of at most ~1 GiB of fp32 gradient: bounded temporaries.
        start, i = 0, 0
        while i < self.owned:
            j, size = i, 0
            while j < self.owned and (j == i or (size + self.numels[j]) * 4 <= 1 << 30):
                size += self.numels[j]
                j += 1
            g = self.grads[start : start + size].float()
            mm, vv, ww = m[start : start + size], v[start : start + size], master[start : start + size]
            mm.lerp_(g, 1 - b1)
            vv.mul_(b2).addcmul_(g, g, value=1 - b2)
            ww.addcdiv_(mm, vv.sqrt().add_(eps), value=-lr)
            offset = 0
            dsts, srcs = [], []
            for k in range(i, j):
                dsts.append(self.weights[k])
                srcs.append(ww[offset : offset + self.numels[k]].view(self.shapes[k]))
                offset += self.numels[k]
            torch._foreach_copy_(dsts, srcs)  # fp32 master → bf16 weights
            start += size
            i = j

    # --- offload / onload --------------------------------------------------------------------------

    def offload(self, parts: Iterable[Part], *, before_drop: Callable[[], object] | None = None) -> OffloadReport:
        """Copy each part to its pinned host buffer (grads are dropped, not copied) and drop its GPU storage;
        ``before_drop`` runs once the copies have landed, before any storage goes (e.g. waiting for a weight
        push that reads the same tensors)."""
        t0 = time.perf_counter()
        done: list[Part] = []
        copied = dropped = 0
        for part in _ordered(parts):
            if not self.resident(part):
                continue
            if part != "grads":
                host = self._host_buffer(part)
                with self._copying():
                    for dst, src in self._pieces(self._pairs(part, host)):
                        dst.copy_(src, non_blocking=self._pin)
                copied += self.nbytes(part)
            dropped += self.nbytes(part)
            done.append(part)
        self._copies_landed()  # the host copies must land before the storage goes
        if before_drop is not None:
            before_drop()
        for part in done:
            setattr(self, _attr(part), None)
        return OffloadReport(tuple(done), copied, dropped, time.perf_counter() - t0)

    def onload(self, parts: Iterable[Part]) -> OffloadReport:
        """Allocate each part again and copy its host buffer back (grads come back zeroed)."""
        t0 = time.perf_counter()
        done: list[Part] = []
        copied = allocated = 0
        for part in _ordered(parts):
            if self.resident(part):
                continue
            if part == "weights":
                self.weights = [torch.empty(s, dtype=torch.bfloat16, device=self.device) for s in self.shapes]
            elif part == "grads":
                self.grads = torch.zeros(self.param_numel, dtype=torch.bfloat16, device=self.device)
            else:
                self.optimizer = torch.empty(3 * self.shard_numel, dtype=torch.float32, device=self.device)
            if part != "grads":
                with self._copying():
                    for host, gpu in self._pieces(self._pairs(part, self._host[part])):
                        gpu.copy_(host, non_blocking=self._pin)
                copied += self.nbytes(part)
            allocated += self.nbytes(part)
            done.append(part)
        self._copies_landed()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the grads' zero fill
        return OffloadReport(tuple(done), copied, allocated, time.perf_counter() - t0)

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Queue copies on the state's stream, behind what the caller's stream has queued so far (the last
        optimizer step writing the tensors, or a freed block's last use before it was handed out again)."""
        if self._copy_stream is None:
            yield
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            yield

    def _copies_landed(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def _pieces(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The pairs cut into copies of at most ``COPY_PIECE_BYTES``: one 12 GB copy holds the GPU's copy engine
        for a quarter of a second, so another process's work (an engine allocating its memory back) waits
        behind it; pieces let it in between, at the same bandwidth."""
        for a, b in pairs:
            step = max(1, COPY_PIECE_BYTES // a.element_size())
            if a.numel() <= step:
                yield a, b
                continue
            fa, fb = a.reshape(-1), b.reshape(-1)  # both contiguous: views, not copies
            for start in range(0, fa.numel(), step):
                yield fa[start : start + step], fb[start : start + step]

    def pinned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host.values())

    def _host_buffer(self, part: Part) -> torch.Tensor:
        if part not in self._host:
            dtype = torch.bfloat16 if part == "weights" else torch.float32
            numel = self.param_numel if part == "weights" else 3 * self.shard_numel
            self._host[part] = torch.empty(numel, dtype=dtype, pin_memory=self._pin)
        return self._host[part]

    def _pairs(self, part: Part, host: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host view, GPU tensor) pairs of a part, in its host buffer's layout."""
        if part == "optimizer":
            assert self.optimizer is not None
            return [(host, self.optimizer)]
        assert self.weights is not None
        out, offset = [], 0
        for w, n in zip(self.weights, self.numels, strict=True):
            out.append((host[offset : offset + n].view(w.shape), w))
            offset += n
        return out


def _attr(part: Part) -> str:
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; known: {PARTS}")
    return part


def _ordered(parts: Iterable[Part]) -> list[Part]:
    wanted = set(parts)
    unknown = wanted - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {PARTS}")
    return [p for p in PARTS if p in wanted]
