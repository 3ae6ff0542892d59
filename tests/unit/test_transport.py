"""One Transport vocabulary: policies plan with it, engines advertise it, producers and the API speak it."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from colocd.api.schemas import ChunkDescriptor
from colocd.daemon.config import NodeConfig
from colocd.daemon.policy_runtime import PolicyRuntime
from colocd.engines.config import ReferenceEngineConfig, SGLangEngineConfig, VLLMEngineConfig
from colocd.engines.sglang.adapter import SGLangAdapter
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.policies import Transport
from colocd.trainer.producer import Producer


def test_every_transport_has_a_producer_and_a_variant_travels_as_its_base() -> None:
    assert all(Producer(t).transport is t for t in Transport)
    assert Transport.PER_TENSOR.wire is Transport.CUDA_IPC
    assert Producer("shm").transport is Transport.SHM
    with pytest.raises(ValueError, match="unknown transport 'carrier_pigeon'"):
        Producer("carrier_pigeon")


def test_a_chunk_names_the_transport_it_travels_as() -> None:
    chunk = {"seq": 0, "transport": "cuda_ipc", "nbytes": 1, "handle": {"payload_b64": ""}}
    assert ChunkDescriptor.model_validate(chunk).transport is Transport.CUDA_IPC
    with pytest.raises(ValidationError, match="'per_tensor' travels as 'cuda_ipc'"):
        ChunkDescriptor.model_validate({**chunk, "transport": "per_tensor"})
    with pytest.raises(ValidationError):
        ChunkDescriptor.model_validate({**chunk, "transport": "auto"})


async def test_engines_advertise_what_they_load() -> None:
    async with httpx.AsyncClient() as client:
        sglang = SGLangAdapter(SGLangEngineConfig(name="s", url="http://127.0.0.1:1"), client)
        cpu_reference = SGLangAdapter(ReferenceEngineConfig(name="r", url="http://127.0.0.1:1"), client)
        gpu_reference = SGLangAdapter(ReferenceEngineConfig(name="g", url="http://127.0.0.1:1", device="cuda"), client)
        vllm = VLLMAdapter(VLLMEngineConfig(name="v", url="http://127.0.0.1:1"), client)
        # SGLang loads no colocd format: before attach it is assumed on a GPU; inline it loads anywhere. The
        # reference engine loads what SGLang loads, on the device its config names.
        assert sglang.transports == {Transport.CUDA_IPC, Transport.PER_TENSOR, Transport.INLINE}
        assert cpu_reference.transports == {Transport.INLINE}
        assert gpu_reference.transports == sglang.transports
        assert vllm.transports == {Transport.SHM, Transport.DISK, Transport.CUDA_IPC}  # before attach: a GPU


def test_the_plan_picks_the_fastest_transport_every_engine_accepts() -> None:
    runtime = PolicyRuntime(NodeConfig())
    both = frozenset({Transport.CUDA_IPC, Transport.PER_TENSOR}) & frozenset(Transport)
    assert runtime.pipeline_plan(runtime.active, both).transport is Transport.CUDA_IPC
    assert runtime.pipeline_plan(runtime.active, frozenset({Transport.SHM, Transport.DISK})).transport is Transport.SHM
    assert runtime.pipeline_plan(runtime.active, None).transport is Transport.SHM  # no engines: the CPU default
    sglang_on_cpu = frozenset({Transport.INLINE})
    assert runtime.pipeline_plan(runtime.active, sglang_on_cpu).transport is Transport.INLINE
