"""Starts an SGLang server with the flags colocation needs: ``sglang_command`` is pure (config in, argv and
environment out); ``launch_sglang`` hands it to ``engines/processes.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ...errors import EngineLaunchError
from ..config import SGLangEngineConfig
from ..processes import Launched, LaunchOptions, flag_values, gpu_environment, launch_until_healthy
from .protocol import parse_version

__all__ = ["launch_sglang", "sglang_command"]

# Flags colocd sets from the engine config; launch.args may not set them again.
_OWNED_FLAGS = {
    "--host": "host (colocd binds 127.0.0.1)",
    "--port": "port (from 'url' or picked free)",
    "--model-path": "model_path",
    "--model": "model_path",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--tp": "tp_size",
    "--api-key": "api_key",
}
# First release verified to have --weight-cache-mode (arg_groups/fields/model.py:377); 0.5.9 lacks it.
_WEIGHT_CACHE_FLAG_MIN = (0, 5, 23)


def sglang_command(
    config: SGLangEngineConfig,
    port: int,
    *,
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
    sglang_version: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and full environment that start ``config``'s server on 127.0.0.1:``port`` (``--device cpu`` in
    ``launch.args``: SGLang's CPU engine, without ``--enable-memory-saver``). ``sglang_version``, when known, drops
    flags it lacks. Raises ``EngineLaunchError`` naming the setting for anything that would break colocation.
    """
    if config.launch is None:
        raise EngineLaunchError(config.name, f"has no 'launch' section: colocd attaches to {config.url}")
    if not config.model_path:
        raise EngineLaunchError(config.name, "set 'model_path' to launch SGLang")
    extra = list(config.launch.args)
    given = flag_values(config.name, extra, _OWNED_FLAGS)
    cache_mode = given.get("--weight-cache-mode")
    if "--weight-cache-mode" in given and cache_mode != "off":
        # Not off: release/resume of weights and every update_weights_from_* raise
        # (weight_updater.py _assert_weight_cache_inactive; research §1.1).
        raise EngineLaunchError(
            config.name, f"--weight-cache-mode {cache_mode} disables weight updates; use off"
        )
    for flag in ("--dp-size", "--data-parallel-size"):
        if given.get(flag) not in (None, "1"):
            # Tensor and distributed updates assert dp_size == 1 (research §1.6): one server per replica.
            raise EngineLaunchError(
                config.name, f"{flag} {given[flag]}; run one SGLang server per DP replica"
            )

    on_cpu = given.get("--device") == "cpu"
    if on_cpu and "--enable-memory-saver" in given:
        raise EngineLaunchError(
            config.name, "--enable-memory-saver with --device cpu: torch_memory_saver has only CUDA hooks and "
            "the server dies at start; on CPU colocd launches without it (releases then free nothing)"
        )
    argv = [
        python, "-m", "sglang.launch_server",
        "--model-path", config.model_path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp-size", str(config.tp_size),
    ]  # fmt: skip
    if not on_cpu:
        # Without it release/resume only log a warning and free nothing (sgl-project/sglang#4566).
        argv.append("--enable-memory-saver")
    if "--weight-cache-mode" not in given and (
        sglang_version is None or parse_version(sglang_version)[:3] >= _WEIGHT_CACHE_FLAG_MIN
    ):
        argv += ["--weight-cache-mode", "off"]
    if config.api_key:
        # Visible in the process table to local users; control routes then need the bearer key.
        argv += ["--api-key", config.api_key]
    argv += extra

    env = dict(os.environ if environ is None else environ)
    for key, value in config.launch.env.items():
        env[key] = value
    if on_cpu:
        # --device cpu alone leaves SGLang's is_cpu() False and the model build imports vllm
        # (0.5.23 utils/common.py:221-224): the CPU engine needs this too.
        if config.launch.env.get("SGLANG_USE_CPU_ENGINE", "1") != "1":
            raise EngineLaunchError(config.name, "--device cpu with launch.env SGLANG_USE_CPU_ENGINE="
                              f"{config.launch.env['SGLANG_USE_CPU_ENGINE']}: SGLang's CPU engine needs it 1")
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    graph_var = config.launch.env.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH")
    if config.memory_saver_cuda_graph:
        if graph_var not in (None, "1", "true", "True"):
            raise EngineLaunchError(
                config.name, f"launch.env SGLANG_MEMORY_SAVER_CUDA_GRAPH={graph_var} "
                "contradicts memory_saver_cuda_graph: true"
            )
        # Graph memory goes into the cuda_graph tag only with this set (environ.py:1645); NCCL's
        # graph buffer registration must be off or replays hang after a resume
        # (fzyzcjy/torch_memory_saver#88, sgl-project/sglang#40648).
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
        env["NCCL_GRAPH_REGISTER"] = "0"
    else:
        if graph_var is not None:
            raise EngineLaunchError(
                config.name, "launch.env sets SGLANG_MEMORY_SAVER_CUDA_GRAPH; "
                "set memory_saver_cuda_graph in the engine config instead, so colocd knows the tag owns "
                "memory"
            )
        # An inherited setting would make the cuda_graph tag own memory the daemon does not expect.
        env.pop("SGLANG_MEMORY_SAVER_CUDA_GRAPH", None)

    gpu_environment(config.name, env, config.launch.env, config.gpu_uuids or [str(g) for g in config.gpus],
                    config.tp_size)
    return argv, env


async def launch_sglang(config: SGLangEngineConfig, options: LaunchOptions | None = None) -> Launched:
    """Start ``config``'s server under ``$COLOCD_SGLANG_PYTHON`` (else this interpreter) on ``config.url``'s port
    (else a free one) and return once ``/health`` answers 200 (``launch_until_healthy``)."""
    if config.launch is None:
        raise EngineLaunchError(config.name, "has no 'launch' section")
    python = os.environ.get("COLOCD_SGLANG_PYTHON") or sys.executable
    process, url = await launch_until_healthy(
        config.name, "SGLang",
        lambda port: sglang_command(config, port, python=python),
        url=config.url or None, log_file=config.launch.log_file,
        ready_timeout_s=config.launch.ready_timeout_s, on_spawn=(options or LaunchOptions()).on_spawn)
    return Launched(url, process)

