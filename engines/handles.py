"""A chunk handle, typed per transport on the wire, and what the daemon reads of it (its route and layout).

The API parses a chunk's handle once, into its transport's model (``parse_handle``): a malformed field is the
caller's 422 naming it before any engine sees the chunk. The model keeps the JSON object it was parsed from
(``wire``), which the adapters forward byte for byte; the orchestration reads only the route (``HandleRoute``) and,
through ``inspect``, what only this node can check (a segment or file that exists) and the chunk's layout.
The colocd formats (shm, disk, inline) refuse keys their model does not name; cuda_ipc keeps them (they are the
engine's) but refuses another colocd transport's fields.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SkipValidation, StringConstraints, model_validator
from pydantic_core import InitErrorDetails, ValidationError

from ..errors import RequestInvalid
from ..policies import Transport
from .chunks import SHM_DIR, SHM_NAME_PATTERN, ChunkLayout, LayoutEntry, layout_of
from .inline import check_inline_payload

__all__ = ["CudaIpcHandle", "DiskHandle", "Handle", "HandleModel", "HandleRoute", "HostRoute", "InlineHandle",
           "LayoutEntry", "PayloadRoute", "ShmHandle", "ShmRoute", "handle_model", "parse_handle"]


# Every route says ``device_uuid``: the GPU the trainer exported the bytes from (None: not known).


@dataclass(frozen=True, slots=True)
class ShmRoute:
    """A shared-memory segment by name (checked against the colocd pattern before any engine sees it)."""

    device_uuid: str | None
    shm_name: str | None


@dataclass(frozen=True, slots=True)
class PayloadRoute:
    """An engine payload in the handle itself, as SGLang loads it: a GPU bucket's (or per-tensor) IPC handles
    (cuda_ipc) or the tensors' bytes (inline), and SGLang's name for its form."""

    device_uuid: str | None
    payload_b64: str | None = None
    load_format: str | None = None


@dataclass(frozen=True, slots=True)
class HostRoute:
    """Bytes the engine reads from this host by itself: a file (disk)."""

    device_uuid: str | None


HandleRoute = ShmRoute | PayloadRoute | HostRoute


_Text = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


_DeviceUuid = Annotated[str | None, Field(max_length=256, description=(
    "the GPU the trainer exported the bytes from (its UUID); a rank that did not join joins on it"))]


class Handle(BaseModel):
    """What every transport's handle may say."""

    model_config = ConfigDict(extra="allow", strict=True)
    # Fields of the other colocd transports: refused where extra keys are otherwise kept (the GPU transports).
    foreign_fields: ClassVar[frozenset[str]] = frozenset()

    # Checked once where the chunk is inspected (``inspect``: chunks.layout_of), not on the API's hot path.
    layout: SkipValidation[list[LayoutEntry] | None] = Field(None, description=(
        "[{name, dtype, shape, offset}]: every transport carries one"))
    _wire: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _no_foreign_fields(cls, value: object) -> object:
        if isinstance(value, dict) and (wrong := sorted(cls.foreign_fields.intersection(value))):
            raise ValidationError.from_exception_data(cls.__name__, [
                InitErrorDetails(type="extra_forbidden", loc=(name,), input=value[name]) for name in wrong])
        return value

    @property
    def wire(self) -> dict[str, Any]:
        """The JSON object this handle was parsed from: what an adapter forwards to its engine."""
        return self._wire

    def route(self) -> HandleRoute:
        return HostRoute(None)

    def inspect(self, nbytes: int) -> ChunkLayout:
        """What only this node can tell of the handle, checked before any engine sees it (422 naming the field),
        and the chunk's layout (every transport carries one)."""
        raise RequestInvalid(f"no transport loads a {type(self).__name__}", field="transport")


_ColocdFormat = ConfigDict(extra="forbid", strict=True)  # read by colocd's own loaders: no other key


class ShmHandle(Handle):
    """shm: a colocd trainer's shared-memory segment on this node."""

    model_config = _ColocdFormat

    shm_name: Annotated[str, StringConstraints(pattern=SHM_NAME_PATTERN.pattern)] = Field(..., description=(
        "a colocd trainer segment (colocd-<pid>-<hex>), never another program's /dev/shm file"))
    nbytes: Annotated[int, Field(ge=0)] = Field(..., description="equal to the chunk's nbytes")

    def route(self) -> HandleRoute:
        return ShmRoute(None, self.shm_name)

    def inspect(self, nbytes: int) -> ChunkLayout:
        """The segment exists and holds the chunk's ``nbytes``."""
        if self.nbytes != nbytes:
            raise RequestInvalid(f"handle.nbytes must be the chunk's nbytes ({nbytes}), got {self.nbytes!r}",
                                 field="handle.nbytes")
        try:
            size = os.stat(os.path.join(SHM_DIR, self.shm_name)).st_size
        except FileNotFoundError:
            raise RequestInvalid(f"no shared-memory segment {self.shm_name!r} on this node",
                                 field="handle.shm_name") from None
        if size < nbytes:
            raise RequestInvalid(f"segment {self.shm_name!r} holds {size} bytes but the chunk says nbytes={nbytes}",
                                 field="nbytes")
        return layout_of("shm", self.layout, nbytes)


class DiskHandle(Handle):
    """disk: a safetensors file on this node."""

    model_config = _ColocdFormat

    path: _Text = Field(..., description="an absolute path to a regular file on this node")

    def inspect(self, nbytes: int) -> ChunkLayout:
        """The file exists here."""
        if not os.path.isabs(self.path) or not os.path.isfile(self.path):
            raise RequestInvalid(f"path {self.path!r} is not an absolute path to a file on this node",
                                 field="handle.path")
        return layout_of("disk", self.layout, None)


class InlineHandle(Handle):
    """inline: the tensors' bytes in the handle, plainly pickled (engines/inline.py checks the pickle)."""

    model_config = _ColocdFormat

    payload_b64: str = Field(..., description="standard base64 of the pickle")
    load_format: str | None = Field(None, max_length=256, description=(
        "SGLang's name for the pickle's form (flattened_bucket, the default; direct)"))

    def route(self) -> HandleRoute:
        return PayloadRoute(None, self.payload_b64, self.load_format)

    def inspect(self, nbytes: int) -> ChunkLayout:
        """One well-formed pickle of allow-listed names (engines/inline.py)."""
        check_inline_payload(self.payload_b64)
        return layout_of("inline", self.layout, nbytes)


class CudaIpcHandle(Handle):
    """cuda_ipc: a GPU bucket (or per-tensor IPC handles) exported by the trainer."""

    foreign_fields: ClassVar[frozenset[str]] = frozenset({"shm_name", "path"})

    device_uuid: _DeviceUuid = None
    payload_b64: str = Field(..., description="standard base64 of the engine's IPC payload")
    load_format: str | None = Field(None, max_length=256, description=(
        "SGLang's name for the payload's form (flattened_bucket; direct for per_tensor chunks)"))

    def route(self) -> HandleRoute:
        return PayloadRoute(self.device_uuid, self.payload_b64, self.load_format)

    def inspect(self, nbytes: int) -> ChunkLayout:
        """The payload is base64 (what it names opens only in the engine)."""
        try:
            base64.b64decode(self.payload_b64, validate=True)
        except ValueError as exc:  # binascii.Error, or a character outside ASCII
            raise RequestInvalid(f"payload_b64 is not base64: {exc}", field="handle.payload_b64") from None
        return layout_of("cuda_ipc", self.layout, None)


HandleModel = ShmHandle | DiskHandle | InlineHandle | CudaIpcHandle
"""Each transport's handle, as the OpenAPI schema lists them."""

_MODELS: dict[Transport, type[Handle]] = {
    Transport.SHM: ShmHandle, Transport.DISK: DiskHandle, Transport.INLINE: InlineHandle,
    Transport.CUDA_IPC: CudaIpcHandle,
}


def handle_model(transport: Transport) -> type[Handle]:
    """The model a chunk of ``transport`` carries its handle in (as the chunk travels: ``Transport.wire``)."""
    return _MODELS.get(Transport(transport).wire, Handle)


def parse_handle(transport: Transport, handle: object) -> Handle:
    """``handle`` parsed into its transport's model, keeping the object it came from (``Handle.wire``)."""
    model = handle_model(transport).model_validate(handle)
    if isinstance(handle, dict):
        model._wire = handle
    return model
