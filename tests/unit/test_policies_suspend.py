"""Suspend capability detection on the trainer side: every reason to fall back is named."""

from __future__ import annotations

import pytest
import torch
from torch.torch_version import TorchVersion

from colocd.trainer.groups import detect_suspend_capability

CUDA = torch.device("cuda", 0)  # constructing a device needs no GPU


@pytest.fixture
def suspend_capable_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules after the torch-version one are checked as on a torch that has suspend, whatever
    torch this machine runs (the GPU machine has 2.11, which stops at the first rule)."""
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.13.0"))


def test_cpu_has_no_suspend() -> None:
    cap = detect_suspend_capability(torch.device("cpu"), ["gloo"])
    assert not cap.supported and "CPU" in cap.reason


@pytest.mark.usefixtures("suspend_capable_torch")
def test_gloo_groups_cannot_be_suspended() -> None:
    cap = detect_suspend_capability(CUDA, ["nccl", "gloo"])
    assert not cap.supported and "gloo" in cap.reason


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.9.1"])
def test_torch_before_2_12_cannot_suspend(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    cap = detect_suspend_capability(CUDA, ["nccl"])
    assert not cap.supported and version in cap.reason


@pytest.mark.parametrize(
    ("nccl", "cumem", "supported", "needle"),
    [
        ((2, 28, 9), None, False, "< 2.29.7"),
        ((2, 29, 7), "0", False, "NCCL_CUMEM_ENABLE=0"),
        ((2, 29, 7), None, True, "NCCL 2.29.7"),
        ((2, 30, 3), "1", True, "NCCL 2.30.3"),
    ],
)
@pytest.mark.usefixtures("suspend_capable_torch")
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
