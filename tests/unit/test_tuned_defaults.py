"""What a user gets without tuning is the `tuned` preset of `python3 -m benchmarks.switch` (issue 12 item 4):
the daemon's default policy document and ``WeightPusher``'s defaults."""

from __future__ import annotations

import torch

from benchmarks.switch import PRESETS
from colocd.policies import default_policies, load_policy_yaml
from colocd.trainer.push import DEFAULT_BUCKET_MB, DEFAULT_DEPTH, WeightPusher, auto_bucket_bytes, auto_transport

MIB = 1 << 20


def test_the_default_pipeline_and_cleanup_are_the_tuned_presets() -> None:
    tuned = load_policy_yaml(PRESETS["tuned"].policy_yaml("auto"))
    defaults = default_policies()
    assert defaults.pipeline.settings() == tuned.pipeline.settings()
    assert defaults.cleanup.settings() == tuned.cleanup.settings()
    # Process groups stay deferred_cooldown: tuned's auto (keep only <= 0.25 GiB) needs an operator to
    # accept a memory budget (max_resident_gib is required), and on a Megatron rank's 14 groups
    # (5.6-7.3 GiB measured) it takes this same deferred_cooldown branch.
    assert defaults.process_groups.spec == "deferred_cooldown"


def test_the_pushers_defaults_match_the_default_plan() -> None:
    plan = default_policies().pipeline
    assert (DEFAULT_DEPTH, DEFAULT_BUCKET_MB) == (plan.config.depth, plan.config.bucket_mb)


def test_auto_transport_follows_the_tensors_device() -> None:
    assert auto_transport(torch.device("cpu")) == "shm"
    assert auto_transport(torch.device("cuda", 0)) == "cuda_ipc"  # fresh buckets: nothing kept exported


def test_auto_buckets_are_2_gib_unless_depth_of_them_would_not_fit_where_they_are_staged() -> None:
    import os

    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    bucket = auto_bucket_bytes("shm", torch.device("cpu"), DEFAULT_DEPTH)
    assert bucket == min(DEFAULT_BUCKET_MB * MIB, max(MIB, free // DEFAULT_DEPTH))
    assert auto_bucket_bytes("disk", torch.device("cpu"), DEFAULT_DEPTH) == DEFAULT_BUCKET_MB * MIB


def test_a_default_pusher_on_cpu_tensors_streams_over_shared_memory() -> None:
    pusher = WeightPusher(client=None)  # type: ignore[arg-type]
    assert pusher._producer_for(torch.device("cpu")).transport == "shm"
    assert MIB <= pusher._chunk_bytes <= DEFAULT_BUCKET_MB * MIB
    explicit = WeightPusher(client=None, transport="disk", bucket_mb=8)  # type: ignore[arg-type]
    assert explicit._producer_for(torch.device("cpu")).transport == "disk" and explicit._chunk_bytes == 8 * MIB


def test_trainer_client_push_weights_takes_weight_pushers_defaults() -> None:
    import inspect

    from colocd.trainer import TrainerClient

    pusher = inspect.signature(WeightPusher.__init__).parameters
    client = inspect.signature(TrainerClient.push_weights).parameters
    shared = {"transport", "bucket_mb", "depth"}
    assert {n: client[n].default for n in shared} == {n: pusher[n].default for n in shared}


def test_auto_picks_what_the_engines_load_in_the_devices_order() -> None:
    assert auto_transport(torch.device("cpu"), ["inline", "cuda_ipc", "per_tensor"]) == "inline"  # SGLang
    assert auto_transport(torch.device("cpu"), ["shm", "disk", "inline"]) == "shm"
    assert auto_transport(torch.device("cuda", 0), ["inline", "cuda_ipc"]) == "cuda_ipc"
    assert auto_transport(torch.device("cpu"), []) == "shm"  # no word from the daemon: the device's first
