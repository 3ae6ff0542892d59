"""The ``inline`` transport's payload: a plainly pickled CPU ``flattened_bucket``, checked without unpickling.

``payload_b64`` is base64 of ``pickle.dumps({"flattened_tensor": uint8 CPU tensor, "metadata": [...]})``, SGLang's
``update_weights_from_tensor`` format by value, which a real SGLang loads on any device. The daemon never unpickles
it: it walks the opcodes and refuses anything but one well-formed pickle naming only the globals a plain tensor
pickle needs, since a payload SGLang cannot load kills its scheduler and the whole server.
"""

from __future__ import annotations

import base64
import binascii
import pickletools
from typing import Any

from ..errors import RequestInvalid

__all__ = ["INLINE_GLOBALS", "check_inline_payload"]

# What pickle.dumps of a dict of CPU tensors and SimpleNamespace metadata names (torch 2.x): all on
# SGLang's SafeUnpickler allow-list (0.5.23 utils/common.py:3148-3370, _load_from_bytes at :3362).
INLINE_GLOBALS = frozenset({
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "int"),
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("types", "SimpleNamespace"),
    ("torch", "Size"), ("torch", "device"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "_load_from_bytes"),
    *(("torch", d) for d in ("uint8", "int8", "int16", "int32", "int64", "bool", "float16", "bfloat16",
                             "float32", "float64", "float8_e4m3fn", "float8_e5m2")),
})

_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                         "SHORT_BINSTRING"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


def check_inline_payload(payload_b64: Any) -> None:
    """Raise ``RequestInvalid`` (field ``handle.payload_b64``) unless ``payload_b64`` is base64 of one pickle
    naming only INLINE_GLOBALS; the stack is modelled only for the strings a ``STACK_GLOBAL`` takes."""
    if not isinstance(payload_b64, str) or not payload_b64:
        raise _refused("an inline chunk carries its tensors as a 'payload_b64' string")
    try:
        raw = base64.b64decode(payload_b64, validate=True)
    except (binascii.Error, ValueError):
        raise _refused("payload_b64 is not base64") from None
    if not raw.startswith(b"\x80"):
        raise _refused("payload_b64 is not a pickle (protocol 2 or later)")
    stack: list[str | None] = []
    memo: dict[int, str | None] = {}
    stopped_at: int | None = None
    try:
        for op, arg, pos in pickletools.genops(raw):
            if op.name == "STOP":
                stopped_at = pos
                break
            if op.name == "GLOBAL":  # protocol < 4: "module name" in the argument
                module, _, name = str(arg).partition(" ")
                _check_global(module, name)
            elif op.name == "STACK_GLOBAL":
                if len(stack) < 2 or not isinstance(stack[-1], str) or not isinstance(stack[-2], str):
                    raise _refused("payload names a global whose name is not a plain string")
                _check_global(stack[-2], stack[-1])
            if op.name in _MEMO_PUT:
                memo[int(str(arg))] = stack[-1] if stack else None
                continue
            if op.name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else None
                continue
            _apply(op, arg, stack, memo)
    except ValueError as exc:  # pickletools' own complaints: truncated or unknown opcodes
        raise _refused(f"payload is not a well-formed pickle: {exc}") from None
    if stopped_at is None or stopped_at != len(raw) - 1:
        raise _refused("payload is not exactly one pickle (no STOP at its end)")


def _refused(message: str) -> RequestInvalid:
    return RequestInvalid(message, field="handle.payload_b64")


def _check_global(module: str, name: str) -> None:
    if (module, name) not in INLINE_GLOBALS:
        raise _refused(f"payload names {module}.{name}, which an inline chunk of CPU tensors never needs "
                         "(the engine would refuse or die on it)")


def _apply(op: pickletools.OpcodeInfo, arg: Any, stack: list[str | None], memo: dict[int, str | None]) -> None:
    """The opcode's effect on the modelled stack: its inputs popped (down to a mark where it takes one), its
    outputs pushed (a string's value, a memo entry's, else an unknown)."""
    before = op.stack_before
    if pickletools.markobject in before:
        while stack and stack.pop() != _MARK:
            pass
        before = [b for b in before if b is not pickletools.markobject and b is not pickletools.stackslice]
    for _ in before:
        if stack:
            stack.pop()
    if op.name in _STRING_OPS:
        stack.append(arg if isinstance(arg, str) else None)
    elif op.name in _MEMO_GET:
        stack.append(memo.get(int(str(arg))))
    else:
        for item in op.stack_after:
            stack.append(_MARK if item is pickletools.markobject else None)


_MARK = "\x00colocd-mark\x00"  # a mark on the modelled stack: no real module or name contains NUL
