"""Suspend capability detection on the trainer side: every reason to fall back is named."""

from __future__ import annotations

import pytest
import torch

from colocd.engines.trainer.groups import detect_suspend_capability

CUDA = torch.device("cuda", 0)  # constructing a device needs no GPU


def test_cpu_has_no_suspend() -> None:
    cap = detect_suspend_capability(torch.device("cpu"), ["gloo"])
    assert not cap.supported and "CPU" in cap.reason


def test_gloo_groups_cannot_be_suspended() -> None:
    cap = detect_suspend_capability(CUDA, ["nccl", "gloo"])
    assert not cap.supported and "NCCL groups only" in cap.reason


@pytest.mark.parametrize(
    ("nccl", "cumem", "supported", "needle"),
    [
        ((2, 28, 9), None, False, "< 2.29.7"),
        ((2, 29, 7), "0", False, "NCCL_CUMEM_ENABLE=0"),
        ((2, 29, 7), None, True, "NCCL 2.29.7"),
        ((2, 30, 3), "1", True, "NCCL 2.30.3"),
    ],
)
def test_nccl_version_and_cumem_decide(
    monkeypatch: pytest.MonkeyPatch,
    nccl: tuple[int, int, int],
    cumem: str | None,
    supported: bool,
    needle: str,
) -> None:
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)
    if cumem is None:
        monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_CUMEM_ENABLE", cumem)
    cap = detect_suspend_capability(CUDA, ["nccl"])
    assert cap.supported is supported
    assert needle in cap.reason
