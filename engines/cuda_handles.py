"""A GPU named by UUID, as SGLang names it in a CUDA IPC payload (trainer and engine may number GPUs differently)."""

from __future__ import annotations

import torch

__all__ = ["device_uuid"]


def device_uuid(index: int) -> str:
    """The GPU's UUID in SGLang's spelling (utils/patch_torch.py:86), stable across CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(index).uuid)

