"""The C boundary: each native function's signature, declared once, by name, as its prototype.

A call passes every argument by the prototype's name (`fn(q=..., k=..., ...)`): a missing,
extra or misspelt name is a TypeError before any native code runs, and the order is the
declaration's, not the caller's. Every function returns an int status, 0 for success; the
status is checked in one place (`errcheck`), which raises NativeError naming the function.
"""

from __future__ import annotations

import ctypes
from typing import Any

P, I64, F32, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

# The leading arguments of both attention kernels (decode_attention.c, extend_attention.c).
_ATTENTION = (
    ("q", P), ("k", P), ("v", P), ("k_scales", P), ("v_scales", P), ("out", P),
    ("num_heads", I64), ("num_kv_heads", I64), ("head_dim", I64),
    ("slot_stride", I64), ("head_stride", I64), ("scales_slot_stride", I64),
    ("scales_head_stride", I64), ("kv_mode", I32), ("scale", F32),
)  # fmt: skip
_DECODE_LAYOUT = (
    ("num_units", I64), ("units", P), ("shared", P), ("own", P), ("member_row", P),
    ("slots", P),
)  # fmt: skip

SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "decode_attention": (*_ATTENTION, *_DECODE_LAYOUT, ("num_threads", I32)),
    "extend_attention": (
        *_ATTENTION, ("num_spans", I64), ("spans", P), ("slots", P), ("num_threads", I32),
    ),
    "rope_store": (
        ("qkv", P), ("num_tokens", I64), ("row_stride", I64), ("num_heads", I64),
        ("num_kv_heads", I64), ("head_dim", I64), ("slot_stride", I64), ("head_stride", I64),
        ("cos", P), ("sin", P), ("out_slots", P), ("k", P), ("v", P), ("k_scales", P),
        ("v_scales", P), ("scales_slot_stride", I64), ("scales_head_stride", I64),
        ("kv_mode", I32), ("qkv_bf16", I32), ("q_out", P), ("num_threads", I32),
    ),
    "add_rms_norm": (
        ("h", P), ("delta", P), ("weight", P), ("out", P), ("num_tokens", I64),
        ("hidden", I64), ("eps", F32), ("bf16", I32), ("num_threads", I32),
    ),
    "silu_mul": (
        ("gate_up", P), ("act", P), ("num_tokens", I64), ("inter", I64), ("bf16", I32),
        ("num_threads", I32),
    ),
    "skinny_linear": (
        ("x", P), ("wp", P), ("y", P), ("M", I64), ("N", I64), ("K", I64), ("bf16", I32),
        ("num_threads", I32),
    ),
    "decode_layers": (
        ("h", P), ("x", P), ("layers", P), ("kv", P), ("slot_stride", I64),
        ("head_stride", I64), ("scales_slot_stride", I64), ("scales_head_stride", I64),
        ("final_norm", P), ("num_layers", I64), ("B", I64),
        ("hidden", I64), ("num_heads", I64), ("num_kv_heads", I64), ("head_dim", I64),
        ("inter", I64), ("eps", F32), ("bf16", I32), ("kv_mode", I32), ("scale", F32),
        ("cos", P), ("sin", P), ("out_slots", P), *_DECODE_LAYOUT, ("quant", I32),
        ("num_threads", I32),
    ),
    "quantize_rows": (
        ("x", P), ("M", I64), ("K", I64), ("bf16", I32), ("fast", I32), ("xq", P), ("sx", P),
        ("sxb", P), ("num_threads", I32),
    ),
    "quant_matmul": (
        ("xq", P), ("sx", P), ("sxb", P), ("M", I64), ("K", I64), ("fast", I32), ("w", P),
        ("N", I64), ("bits", I32), ("sub", I32), ("has_min", I32), ("kscale", I32), ("y", P),
        ("y_stride", I64), ("y_bf16", I32), ("num_threads", I32),
    ),
    "repack_blocks": (
        ("raw", P), ("qtype", I32), ("rows", I64), ("cols", I64), ("row_order", P),
        ("fast", I32), ("records", P), ("num_threads", I32),
    ),
    "quant_rows": (
        ("w", P), ("rows", P), ("num_rows", I64), ("N", I64), ("K", I64), ("fast", I32),
        ("bits", I32), ("sub", I32), ("has_min", I32), ("kscale", I32), ("out", P),
        ("out_bf16", I32),
    ),
}  # fmt: skip


class NativeError(RuntimeError):
    """A native function returned a nonzero status."""


class NativeFunction:
    """One function of the library, called with its prototype's argument names."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.name = name
        self.arg_names = tuple(arg for arg, _ in SIGNATURES[name])
        self._fn = getattr(lib, name)
        self._fn.argtypes = [ctype for _, ctype in SIGNATURES[name]]
        self._fn.restype = ctypes.c_int
        self._fn.errcheck = _check_status

    def __call__(self, **args: Any) -> None:
        if args.keys() != set(self.arg_names):
            unknown = sorted(args.keys() - set(self.arg_names))
            lacking = [a for a in self.arg_names if a not in args]
            raise TypeError(f"{self.name}: unknown arguments {unknown}, missing {lacking}")
        self._fn(*(args[a] for a in self.arg_names))


def bind(lib: ctypes.CDLL) -> dict[str, NativeFunction]:
    """Every declared function of the library, by name."""
    return {name: NativeFunction(lib, name) for name in SIGNATURES}


def _check_status(status: int, fn: Any, args: tuple[Any, ...]) -> int:
    if status != 0:
        raise NativeError(f"{fn.__name__} failed (status {status})")
    return status
