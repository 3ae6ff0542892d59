"""The session's vLLM server runs on the instruction path scripts/vllm_cpu_isa.py chose for this CPU.

Where the CPU reports AMX (or COLOCD_VLLM_CPU_ISA=avx512 asks; the tier runs so on CPUs without AMX to show
the AVX-512 path serves), every worker reads the shim's AMX check, attention takes vLLM's AVX-512 kernel
("vec") and oneDNN is capped; elsewhere the worker reads torch's own check. The rest of the tier then shows
the path serves: same greedy tokens, same checksums. The shim's effect on vLLM's own kernel choice under an
AMX report is checked in the venv too, since no AMX CPU is at hand on a machine without one.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from colocd.engines.processes import Launched
from scripts import vllm_cpu_isa as cpu_isa

pytestmark = pytest.mark.vllm

CHOSEN = cpu_isa.choose(cpu_isa.host_flags(), os.environ.get(cpu_isa.ENV))


async def test_every_worker_runs_on_the_path_chosen_for_this_cpu(vllm_server: Launched,
                                                                 client: httpx.AsyncClient) -> None:
    r = await client.post(f"{vllm_server.url}/collective_rpc", json={"method": "colocd_test_cpu_isa"})
    r.raise_for_status()
    (worker,) = r.json()["results"]
    if CHOSEN == "avx512":
        assert worker == {"amx_check": f"{cpu_isa.MODULE}._report_no_amx", "amx": False,
                          "attention_isa": "vec", "onednn_max_isa": cpu_isa.ONEDNN_ISA}
    else:
        assert worker["amx_check"] == "torch.cpu._is_amx_tile_supported"
        assert worker["onednn_max_isa"] == os.environ.get("ONEDNN_MAX_CPU_ISA")


# torch.cpu reports AMX as on an AMX Xeon; vLLM's attention picks "amx" until the shim holds it to AVX-512.
_PROBE = """
import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from colocd_vllm_cpu_isa import install
real = torch.cpu.get_capabilities
torch.cpu.get_capabilities = lambda: {**real(), "amx_tile": True}
before = _get_attn_isa(torch.bfloat16, 32)
install({"COLOCD_VLLM_CPU_ISA": "avx512"})
print(before, _get_attn_isa(torch.bfloat16, 32))
"""


def test_under_an_amx_report_vllms_attention_leaves_amx_once_the_shim_holds_it(model_dir: Path) -> None:
    python = os.environ["COLOCD_VLLM_PYTHON"]
    env = {**os.environ, cpu_isa.ENV: "native"}  # the .pth hook stays out: this process starts as vLLM's own
    proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["amx", "vec"]
