"""What the adapter reads, parsed from what a live SGLang 0.5.23 answered (tests/contract/fixtures), and the
inline payload check that keeps bytes SGLang cannot unpickle away from it."""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path

import pytest
import sglang_replies as replies
import torch
from sglang_live import differing, parameter_checksums

from colocd.engines.inline import check_inline_payload
from colocd.engines.sglang import wire
from colocd.errors import ReplyInvalid, RequestInvalid
from colocd.trainer.producer import Producer

LIVE = json.loads((Path(__file__).parent.parent / "contract" / "fixtures" / "sglang_live_0_5_23.json")
                  .read_text())["responses"]


def test_live_server_info_parses_and_its_dict_startup_time_gives_an_incarnation() -> None:
    info = wire.parse_reply(wire.ServerInfo, LIVE["server_info"]["body"])
    assert (info.version, info.tp_size, info.device) == ("0.5.23", 1, "cpu")
    assert isinstance(info.startup_time, dict)
    incarnation = info.incarnation()
    assert incarnation is not None and incarnation.startswith("startup:")
    restarted = {**LIVE["server_info"]["body"], "startup_time": {**info.startup_time, "load_weight": 0.1234567}}
    assert wire.parse_reply(wire.ServerInfo, restarted).incarnation() != incarnation


def test_a_numeric_startup_time_is_its_own_incarnation() -> None:
    assert wire.ServerInfo(version="0.5.9", startup_time=1733.5).incarnation() == "1733.5"
    assert wire.ServerInfo(version="0.5.9").incarnation() is None  # cannot tell: never guessed


def test_a_server_info_of_the_wrong_shape_names_the_field() -> None:
    with pytest.raises(ReplyInvalid, match="tp_size"):
        wire.parse_reply(wire.ServerInfo, {"version": "0.5.23", "tp_size": "1"})


def test_live_model_info_and_checksums_parse() -> None:
    assert wire.parse_reply(wire.ModelInfo, LIVE["model_info"]["body"]).weight_version == "default"
    result = wire.parse_reply(replies.CheckWeightsResult, LIVE["weights_checker"]["body"])
    sums = parameter_checksums(result)
    assert len(sums) >= 10 and all(k.startswith("tp0/") for k in sums) and result.checksum()
    assert differing(sums, sums) == [] and differing(sums, {}) == sorted(sums)


def test_an_inline_chunk_passes_the_check() -> None:
    chunk = Producer("inline").export([("w", torch.ones(3, 2, dtype=torch.bfloat16)), ("b", torch.zeros(4))])
    check_inline_payload(chunk.handle["payload_b64"])
    assert chunk.handle["load_format"] == "flattened_bucket" and len(chunk.handle["layout"]) == 2


@pytest.mark.parametrize("payload, why", [
    (base64.b64encode(json.dumps({"transport": "shm"}).encode()).decode(), "not a pickle"),  # colocd's shm JSON
    (base64.b64encode(pickle.dumps(os.system)).decode(), "names posix.system"),
    (base64.b64encode(pickle.dumps([1])[:-1]).decode(), "not a well-formed pickle"),
    (base64.b64encode(pickle.dumps([1]) + b"x").decode(), "not exactly one pickle"),
    ("%%%", "not base64"),
])
def test_what_sglangs_scheduler_would_die_on_is_refused(payload: str, why: str) -> None:
    with pytest.raises(RequestInvalid, match=why):
        check_inline_payload(payload)
