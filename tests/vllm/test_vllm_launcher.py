"""The launcher's command line and failure messages, and the extension's import weight (no server needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from colocd.engines.config import LaunchConfig, VLLMEngineConfig
from colocd.engines.vllm.launcher import EXTENSION_CLS, build_command, launch_vllm
from colocd.errors import EngineLaunchError

pytestmark = pytest.mark.vllm

ENTRY = "vllm.entrypoints.launchers.api_server.entry"


def _config(**kw: object) -> VLLMEngineConfig:
    return VLLMEngineConfig(name="e", model_path="/m", launch=LaunchConfig(args=["--enforce-eager"]), **kw)


def test_gpu_command_has_the_colocation_flags() -> None:
    cmd = build_command(_config(tp_size=2), "/venv/bin/python", ENTRY, 8123, cpu=False)
    assert cmd[:3] == ["/venv/bin/python", "-m", ENTRY]
    flags = " ".join(cmd)
    assert "--host 127.0.0.1 --port 8123" in flags
    assert f"--worker-extension-cls {EXTENSION_CLS}" in flags
    assert "--enable-sleep-mode" in cmd
    assert "--tensor-parallel-size 2" in flags
    assert cmd[-1] == "--enforce-eager"  # operator flags come last and win


def test_cpu_command_leaves_out_sleep_mode_which_vllm_rejects_there() -> None:
    cmd = build_command(_config(), "py", ENTRY, 1, cpu=True)
    assert "--enable-sleep-mode" not in cmd


def test_launch_without_a_model_path_is_a_config_error() -> None:
    with pytest.raises(EngineLaunchError, match="model_path"):
        build_command(VLLMEngineConfig(name="e", launch=LaunchConfig()), "py", ENTRY, 1, cpu=True)


async def test_an_interpreter_without_vllm_fails_with_a_clear_message() -> None:
    with pytest.raises(EngineLaunchError, match="cannot import vLLM"):
        await launch_vllm(_config(python=sys.executable))  # colocd's own env: no vLLM here


def test_the_extension_module_imports_neither_fastapi_nor_httpx_nor_pydantic() -> None:
    code = (
        "import sys, colocd.engines.vllm.extension\n"
        "print([m for m in ('fastapi', 'httpx', 'pydantic', 'uvicorn') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_launch_args_may_not_override_flags_colocd_owns() -> None:
    config = VLLMEngineConfig(name="e", model_path="/m", launch=LaunchConfig(args=["--port=9000"]))
    with pytest.raises(EngineLaunchError, match="--port"):
        build_command(config, "py", ENTRY, 1, cpu=True)


def test_gpu_environment_pins_devices_and_drops_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    from colocd.engines.vllm.launcher import _environment

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    env = _environment(_config(tp_size=2, gpu_uuids=["GPU-a", "GPU-b"]), cpu=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"  # CUDA IPC handles arrive pickled
    with pytest.raises(EngineLaunchError, match="tp_size=2"):
        _environment(_config(tp_size=2, gpus=[0]), cpu=False)
