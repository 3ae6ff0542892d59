"""Let PyPI's torchvision wheel import on a CPU-only torch in colocd's SGLang test venv (test environment only).

SGLang imports torchvision unconditionally, and the wheel registers Python fakes for ``torchvision::nms``
and ``torchvision::qnms`` whose schemas its CUDA-built C++ library would define; without that library the
import fails with "operator torchvision::nms does not exist". Defining the two schemas just before
torchvision is first imported lets it import; no torchvision op runs for a text model. The hook waits for
that import so other programs in the venv (pip) do not pay for importing torch.
scripts/install-sglang-cpu.sh installs this file into that venv's site-packages, nowhere else.
"""

import importlib.abc
import sys

_schemas = []  # the torch.library.Library fragment: its definitions live as long as it does


class _DefineTorchvisionSchemas(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _schemas.append(lib)
        except Exception:  # a torchvision whose library defines them, or no torch: nothing to stand in for
            pass
        return None  # the ordinary finders import torchvision itself


sys.meta_path.insert(0, _DefineTorchvisionSchemas())
