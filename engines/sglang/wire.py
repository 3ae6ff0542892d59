"""SGLang's HTTP request and response bodies as pydantic models, with SGLang's own names, types and defaults.

Request models mirror ``sglang/srt/managers/io_struct.py`` of the 0.5.23 wheel field for field (the line of each
class is cited; ``tests/contract/`` checks every field against the recorded structs of 0.5.4, 0.5.9 and 0.5.23),
less the internal routing fields ``rid`` and ``http_worker_ipc``. Reply models ignore extra keys (SGLang adds
keys between releases) and are strict about the ones colocd reads. ``adapter.py`` does the I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from ...errors import ReplyInvalid
from ..base import PauseMode
from .protocol import SGLangProtocol

__all__ = ["BeginWeightUpdateReqInput", "CheckWeightsReqInput", "ContinueGenerationReqInput",
           "DestroyWeightsUpdateGroupReqInput", "EndWeightUpdateReqInput", "InitWeightsUpdateGroupReqInput",
           "InternalState", "MemoryUsage", "ModelInfo", "PauseGenerationReqInput", "ReleaseMemoryOccupationReqInput",
           "ResumeMemoryOccupationReqInput", "SGLangRequest", "Selector", "ServerInfo", "UpdateWeightVersionReqInput",
           "UpdateWeightsFromDistributedReqInput", "UpdateWeightsFromTensorReqInput", "body",
           "continue_generation_request", "parse_reply", "pause_generation_request"]

# io_struct.py:2017,2045,2200,2223: which model runners an operation applies to.
Selector = Literal["target", "draft", "all"]


class SGLangRequest(BaseModel):
    """Base of every request body: frozen, and the route it is POSTed to. Unknown keys are refused here because
    SGLang ignores them (``msgspec_utils.py`` ``extra_behavior="ignore"``): a misspelt field would do nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ROUTE: ClassVar[str]


# --- memory ----------------------------------------------------------------------------------


class ReleaseMemoryOccupationReqInput(SGLangRequest):
    """io_struct.py:2177; POST /release_memory_occupation (http_server.py:1575): 200 with a JSON ``null``; 400
    ``{"error": {"message"}}`` for a tokenizer-side exception. A scheduler-side failure kills the server."""

    ROUTE: ClassVar[str] = "/release_memory_occupation"
    # io_struct.py:2180. None or [] means every tag; colocd always names them ("all" would release a tag twice).
    tags: list[str] | None = None


class ResumeMemoryOccupationReqInput(SGLangRequest):
    """io_struct.py:2187; POST /resume_memory_occupation (http_server.py:1587). Resuming a tag that is not released
    kills the scheduler (``set.remove`` KeyError), so the daemon names only tags it released."""

    ROUTE: ClassVar[str] = "/resume_memory_occupation"
    tags: list[str] | None = None  # io_struct.py:2190


# --- generation control ----------------------------------------------------------------------


class PauseGenerationReqInput(SGLangRequest):
    """io_struct.py:1927; POST /pause_generation (http_server.py:1831). Before 0.5.6 the route reads no body."""

    ROUTE: ClassVar[str] = "/pause_generation"
    mode: Literal["abort", "retract", "in_place"] = "abort"  # io_struct.py:1946


class ContinueGenerationReqInput(SGLangRequest):
    """io_struct.py:1949; POST /continue_generation (http_server.py:1844)."""

    ROUTE: ClassVar[str] = "/continue_generation"
    # io_struct.py:1955: empty_cache before un-pausing; absent in 0.5.9, whose struct is empty.
    torch_empty_cache: bool = True


# --- weight-update session (0.5.21+) --------------------------------------------------------------


class BeginWeightUpdateReqInput(SGLangRequest):
    """io_struct.py:2197; POST /begin_weight_update (http_server.py:1458); 400 if a session is open. Tensor and
    distributed updates answer ``success: false`` outside one (scheduler_components/weight_updater.py:190-240)."""

    ROUTE: ClassVar[str] = "/begin_weight_update"
    selector: Selector = "all"  # io_struct.py:2200


class EndWeightUpdateReqInput(SGLangRequest):
    """io_struct.py:2208 (no fields); POST /end_weight_update (http_server.py:1473); 400 if no session is open."""

    ROUTE: ClassVar[str] = "/end_weight_update"


# --- weight transfer -------------------------------------------------------------------------


class UpdateWeightsFromTensorReqInput(SGLangRequest):
    """io_struct.py:2027; POST /update_weights_from_tensor (http_server.py:1436). The reply comes once the copies
    are *enqueued*, so the producer must not reuse the exported buffer at once (THUDM/slime#929)."""

    ROUTE: ClassVar[str] = "/update_weights_from_tensor"
    # io_struct.py:2035: one standard-base64 string per TP rank; rank r decodes entry r (tp_worker.py:194-201)
    # with ``b64decode(validate=True)`` (msgspec_utils.py:24).
    serialized_named_tensors: list[str] = Field(min_length=1)
    # io_struct.py:2037: None (named-tensor list), "direct", "flattened_bucket" or a custom loader's path.
    load_format: str | None = None
    # io_struct.py:2039: a refused flush makes the update report failure though the weights changed, so colocd
    # flushes once, after the last chunk, with the engine paused.
    flush_cache: bool = True
    abort_all_requests: bool = False  # io_struct.py:2041
    weight_version: str | None = None  # io_struct.py:2043
    selector: Selector = "all"  # io_struct.py:2045 (absent before 0.5.21 in the bands checked)
    torch_empty_cache: bool = False  # io_struct.py:2047

    @field_validator("serialized_named_tensors")
    @classmethod
    def _standard_base64(cls, entries: list[str]) -> list[str]:
        for rank, entry in enumerate(entries):
            try:
                base64.b64decode(entry, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"serialized_named_tensors[{rank}] is not standard base64: {exc}") from None
        return entries


class UpdateWeightsFromDistributedReqInput(SGLangRequest):
    """io_struct.py:2002; POST /update_weights_from_distributed (http_server.py:1488). The reply comes after the
    NCCL receive, so the trainer broadcasts while this request is in flight."""

    ROUTE: ClassVar[str] = "/update_weights_from_distributed"
    names: list[str]  # io_struct.py:2003
    dtypes: list[str]  # io_struct.py:2004, torch short names, e.g. "bfloat16"
    shapes: list[list[int]]  # io_struct.py:2005
    group_name: str = "weight_update_group"  # io_struct.py:2007
    flush_cache: bool = True  # io_struct.py:2009
    abort_all_requests: bool = False  # io_struct.py:2011
    weight_version: str | None = None  # io_struct.py:2013
    # io_struct.py:2015: "flattened_bucket" receives one unpadded uint8 broadcast (tensor_bucket.py).
    load_format: str | None = None
    selector: Selector = "all"  # io_struct.py:2017
    torch_empty_cache: bool = False  # io_struct.py:2019

    @model_validator(mode="after")
    def _parallel_lists(self) -> UpdateWeightsFromDistributedReqInput:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor; got "
                f"{len(self.names)}, {len(self.dtypes)}, {len(self.shapes)}"
            )
        return self


class InitWeightsUpdateGroupReqInput(SGLangRequest):
    """io_struct.py:2126; POST /init_weights_update_group (http_server.py:1404). Blocks until the NCCL rendezvous
    completes (engine rank = rank_offset + tp_rank; the trainer is rank 0)."""

    ROUTE: ClassVar[str] = "/init_weights_update_group"
    master_address: str  # io_struct.py:2128
    master_port: int = Field(ge=1, le=65535)  # io_struct.py:2130
    rank_offset: int = Field(ge=0)  # io_struct.py:2132
    world_size: int = Field(ge=1)  # io_struct.py:2134
    group_name: str = "weight_update_group"  # io_struct.py:2136
    backend: str = "nccl"  # io_struct.py:2138


class DestroyWeightsUpdateGroupReqInput(SGLangRequest):
    """io_struct.py:2146; POST /destroy_weights_update_group (http_server.py:1420) → success, message."""

    ROUTE: ClassVar[str] = "/destroy_weights_update_group"
    group_name: str = "weight_update_group"  # io_struct.py:2147


class UpdateWeightVersionReqInput(SGLangRequest):
    """io_struct.py:2155; POST /update_weight_version (http_server.py:1527)."""

    ROUTE: ClassVar[str] = "/update_weight_version"
    new_version: str  # io_struct.py:2157
    # io_struct.py:2159: SGLang's default aborts every running request (radixark/miles#2372); kept exact here,
    # callers pass False.
    abort_all_requests: bool = True


class CheckWeightsReqInput(SGLangRequest):
    """io_struct.py:2217; GET or POST /weights_checker (http_server.py:1599)."""

    ROUTE: ClassVar[str] = "/weights_checker"
    action: str = "checksum"  # io_struct.py:2218: "checksum" | "snapshot" | "reset_tensors" | "compare"
    allow_quant_error: bool = False  # io_struct.py:2219
    skip_tensor_list: list[str] | None = None  # io_struct.py:2221
    selector: Selector = "all"  # io_struct.py:2223


# --- responses -------------------------------------------------------------------------------


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ModelInfo(_Reply):
    """GET /model_info (http_server.py:812-850), where 0.5.6+ publishes the current weight version."""

    weight_version: str | None = None


class MemoryUsage(_Reply):
    """``internal_states[].memory_usage`` (0.5.23 scheduler_components/memory_usage.py): the GiB each region took
    when the scheduler's TP rank allocated it, not what it holds now; ``graph`` is per CUDA-graph phase."""

    weight: float = 0.0
    kvcache: float = 0.0
    graph: dict[str, float] = Field(default_factory=dict)

    @field_validator("graph", mode="before")
    @classmethod
    def _phases(cls, value: Any) -> Any:
        return value if isinstance(value, dict) else {}  # older SGLang: a number or nothing


class InternalState(_Reply):
    """One entry of server_info's ``internal_states`` (one per DP rank). Real SGLang reports scheduler
    counters and ``memory_usage`` here; the reference engine adds its pause gate and open weight-update
    session, which real SGLang does not report (absent, not in ``model_fields_set``: "cannot tell"; a key that is
    there may hold a null)."""

    memory_usage: MemoryUsage | None = None
    paused: Any = None
    weight_update_session: Any = None


class ServerInfo(_Reply):
    """Every field of GET /server_info colocd reads (http_server.py:863-894; 0.5.4 /get_server_info:496), checked
    against the live 0.5.23 reply in ``tests/contract/fixtures/sglang_live_0_5_23.json``. ``startup_time`` is a
    dict of startup-phase durations in 0.5.20 and 0.5.23 (tokenizer_manager.py:535)."""

    version: str
    tp_size: StrictInt | None = None  # absent from some builds' replies: then it cannot be checked
    device: str | None = None
    startup_time: float | dict[str, Any] | None = None
    internal_states: list[InternalState] = Field(default_factory=list)
    # LoRA server args (srt/arg_groups/fields/lora.py); None where the server does not say.
    enable_lora: bool | None = None
    max_loaded_loras: int | None = None

    @field_validator("internal_states", mode="before")
    @classmethod
    def _states_list(cls, value: Any) -> Any:
        # Only dict entries carry state; anything else says nothing (and must not fail an attach).
        return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []

    def incarnation(self) -> str | None:
        """What changes exactly when the server process restarted: a start timestamp, or the hash of the startup
        durations a restart measures anew (to the microsecond); None where the engine reports neither."""
        if self.startup_time is None:
            return None
        if isinstance(self.startup_time, float | int):
            return repr(float(self.startup_time))
        canonical = json.dumps(self.startup_time, sort_keys=True, separators=(",", ":"), default=str)
        return "startup:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


_R = TypeVar("_R", bound=BaseModel)


def parse_reply(model: type[_R], data: Any) -> _R:
    """``data`` as ``model``, or ``ReplyInvalid`` naming the first field that does not fit."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(the body)"
        raise ReplyInvalid(f"{model.__name__}.{where}: {first['msg']} (got {str(data)[:200]})") from None


# --- builders --------------------------------------------------------------------------------


def body(model: SGLangRequest, protocol: SGLangProtocol) -> dict[str, Any]:
    """The JSON body for ``model``, defaults included; a field that ``protocol`` lacks is dropped while it holds the
    default and refused otherwise, naming it: that SGLang would ignore the key."""
    data = model.model_dump(mode="json")
    struct = type(model).__name__
    if not protocol.has_struct(struct):
        raise ValueError(
            f"SGLang protocol {protocol.name!r} has no {struct}; {model.ROUTE} takes no such body"
        )
    for name in protocol.fields_absent(struct):
        if name not in data:
            continue
        default = type(model).model_fields[name].get_default(call_default_factory=True)
        if getattr(model, name) != default:
            raise ValueError(
                f"SGLang protocol {protocol.name!r} has no {struct}.{name}; "
                f"it would ignore {name}={getattr(model, name)!r}"
            )
        del data[name]
    return data


def pause_generation_request(protocol: SGLangProtocol, mode: PauseMode | str) -> dict[str, Any] | None:
    """The /pause_generation body for ``mode``, or None where the route reads no body (LEGACY)."""
    if mode not in protocol.pause_modes:
        allowed = ", ".join(m.value for m in protocol.pause_modes)
        raise ValueError(
            f"SGLang protocol {protocol.name!r} cannot pause with mode {PauseMode(mode).value!r}; it has: {allowed} "
            "(set pause_mode in the node config, or engines.pause_mode in the policy document)"
        )
    if not protocol.pause_body:
        return None
    return body(PauseGenerationReqInput.model_validate({"mode": PauseMode(mode).value}), protocol)


def continue_generation_request(protocol: SGLangProtocol) -> dict[str, Any] | None:
    """The /continue_generation body (emptying the cache before un-pausing), or None where the route reads no body
    (LEGACY)."""
    return body(ContinueGenerationReqInput(), protocol) if protocol.continue_body else None
