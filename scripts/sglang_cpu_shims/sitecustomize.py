"""Let PyPI's torchvision wheel import on a CPU-only torch in colocd's SGLang test venv, and SGLang 0.5.20's weight
checksums run there (test environment only).

SGLang imports torchvision unconditionally, and the wheel registers Python fakes for ``torchvision::nms``
and ``torchvision::qnms`` whose schemas its CUDA-built C++ library would define; without that library the
import fails with "operator torchvision::nms does not exist". Defining the two schemas just before
torchvision is first imported lets it import; no torchvision op runs for a text model. The hook waits for
that import so other programs in the venv (pip) do not pay for importing torch.
SGLang 0.5.20's ``/weights_checker`` checksum calls ``torch.cuda.synchronize()`` around its hashing
(srt/utils/weight_checker.py:124-125,150), which a CPU-only torch refuses ("Torch not compiled with CUDA enabled");
0.5.23 does not. The hashing itself has a CPU path (managers/mm_utils.py:838), so on a torch without CUDA the
checksum runs with that synchronize as a no-op: the live tier compares per-parameter checksums on both releases.
SGLang's LoRA code (0.5.20, 0.5.23) pins host memory unconditionally (srt/lora/layers.py, lora.py,
backend/torch_backend.py: ``torch.tensor(..., pin_memory=True)``, ``.pin_memory()``), which a torch without an
accelerator refuses ("pin_memory=True requires a CUDA or other accelerator backend"), so a server started with
--enable-lora dies at start-up. Once ``sglang.srt.lora`` is imported on such a torch, pinning is a no-op: torch's
factories drop ``pin_memory`` and ``Tensor.pin_memory`` returns the tensor (research/lora-engines.md §2.2).
scripts/install-sglang-cpu.sh installs this file into that venv's site-packages, nowhere else.
"""

import importlib.abc
import importlib.machinery
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


def _checksum_without_cuda_sync(checker_class):
    import torch

    original = checker_class._compute_checksum

    def compute(self, *args, **kwargs):
        sync = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: None
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.synchronize = sync

    checker_class._compute_checksum = compute


class _PatchWeightChecker(importlib.abc.MetaPathFinder):
    _NAME = "sglang.srt.utils.weight_checker"

    def find_spec(self, fullname, path, target=None):
        if fullname != self._NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            checker = getattr(module, "WeightChecker", None)
            if not torch.cuda.is_available() and checker is not None and "_compute_checksum" in vars(checker):
                _checksum_without_cuda_sync(checker)

        spec.loader.exec_module = exec_module
        return spec


def _pinning_as_a_no_op():
    import functools

    import torch

    def unpinned(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "as_tensor", "zeros_like", "empty_like",
                 "ones_like", "full_like"):
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *a, **k: self


class _UnpinLoRA(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "sglang.srt.lora":
            return None
        sys.meta_path.remove(self)
        import torch

        if not torch.cuda.is_available():
            _pinning_as_a_no_op()
        return None


sys.meta_path.insert(0, _DefineTorchvisionSchemas())
sys.meta_path.insert(0, _UnpinLoRA())
sys.meta_path.insert(0, _PatchWeightChecker())
