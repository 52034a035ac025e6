"""Native CPU kernels: C sources in csrc/, built per instruction set (native_build.py), called
through ctypes (native_abi.py declares each signature).

    csrc/decode_attention.c   one query per request; requests on a shared run read it once
                              (its loops in decode_task.h; the bfloat16 pool's builds in
                              decode_attention_bf16.c and _dots.c, the int8 pool's in _i8.c,
                              compiled in parallel)
    csrc/extend_attention.c   prefill: new tokens attend causally to their prefix and themselves
    csrc/flash_tile.h         the register-tiled flash attention loops both use
    csrc/simd.h               the vector width and helpers of the build's instruction set
    csrc/rope_store.c         rope on q and k, and the K/V write into the pool, in one call
    csrc/rms_norm.c           the residual add + RMS norm, and silu(gate) * up, one call each
    csrc/skinny_linear.c      linear layers on a packed weight: decode batches stream it, larger
                              ones go through register tiles
    csrc/decode_step.c        a decode step through all the decoder layers, calling the above
    csrc/quant_linear.c       linear layers on quantized weights (quant/): integer dot products

Both attention kernels read K/V where they lie in the pool (float32, bfloat16, or int8 codes
with their scales: cache/kv_quant.py), with no gather. Why C and not a PyTorch extension: a few
small files compile in seconds with the system C compiler and need neither PyTorch's headers
nor ninja.

`kernels()` is the library of the variant this process runs (native_build.chosen_variant: the
CPU's best, or `RADIXLM_ISA`); None with `RADIXLM_NATIVE=0`, without a C compiler, or when the
build fails (logged as an error naming the variant and the compiler's message): callers then use
their PyTorch path. The kernels make things faster, never possible.

OpenMP: the library is linked to libgomp.so.1. PyTorch has already loaded its own libgomp.so.1
into the process by then (it is imported first), and the dynamic loader resolves the name to that
copy, so both use one thread pool rather than fighting over the cores.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixlm.cache.kv_pool import KVScales
from radixlm.model import native_build
from radixlm.model.native_abi import NativeError, NativeFunction, bind
from radixlm.model.native_layout import (
    KV_DTYPES,
    POOL_DTYPES,
    DecodeLayout,
    DecoderShape,
    ExtendLayout,
    can_pack_skinny,
    kv_strides,
    pack_skinny,
    scale_strides,
)

__all__ = [
    "KV_DTYPES",
    "MAX_HEAD_DIM",
    "POOL_DTYPES",
    "SKINNY_MAX_ROWS",
    "DecodeLayout",
    "DecoderShape",
    "ExtendLayout",
    "Kernels",
    "can_pack_skinny",
    "kernels",
    "kernels_for",
    "kv_strides",
    "pack_skinny",
]

if TYPE_CHECKING:
    from radixlm.model.quant import FileBlocks, QuantWeight

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256  # head_dim: a multiple of 16 (whole AVX-512 vectors), at most this
SKINNY_MAX_ROWS = 16  # skinny_linear streams W for up to this many rows; more go through tiles
NATIVE_LINEAR_ROWS = 64  # matmuls up to this many rows go native on every variant (runs_linear)
TILED_PREFILL = ("avx512", "avx2")  # variants whose tiles take prefill chunks too (runs_linear)


def enabled() -> bool:
    """False when RADIXLM_NATIVE=0 asks for the PyTorch paths only."""
    return os.environ.get("RADIXLM_NATIVE", "1") != "0"


def kernels() -> Kernels | None:
    """The kernels this process runs: `RADIXLM_ISA`'s variant (ValueError if this CPU cannot
    execute it) or the CPU's best; None where they are off or cannot be built."""
    if not enabled():
        return None
    return kernels_for(native_build.chosen_variant().name)


@functools.cache
def kernels_for(isa: str) -> Kernels | None:
    """The kernels of variant `isa` (native_build.VARIANTS), loaded once per process; built now
    if the install step did not build them. None without a compiler or when the build fails."""
    variant = native_build.VARIANTS[isa]
    path = native_build.find_library(variant)
    if path is None:
        if native_build.compiler() is None:
            log.warning("no C compiler found: native kernels off, PyTorch paths used")
            return None
        log.warning(
            "the %s native kernels were not built at install (python -m "
            "radixlm.model.native_build): building them now", isa,
        )  # fmt: skip
        try:
            path = native_build.build(variant)
        except (native_build.BuildError, OSError) as exc:
            log.error("%s\nPyTorch paths used instead", exc)
            return None
    try:
        loaded = Kernels(ctypes.CDLL(str(path)), isa)
    except (OSError, AttributeError, RuntimeError) as exc:  # a library that does not load
        log.error("the %s kernels at %s do not load (%s): PyTorch paths used", isa, path, exc)
        return None
    log.info("native kernels: %s (%s)", isa, path)
    return loaded


class Kernels:
    """The compiled library of one variant (`isa`). Arithmetic is float32 whatever the storage
    (but see `extend` for bfloat16 models): queries are widened and outputs narrowed to the
    queries' dtype."""

    def __init__(self, lib: ctypes.CDLL, isa: str):
        self._fn = bind(lib)
        lib.kernels_isa.restype = ctypes.c_char_p
        built_for = lib.kernels_isa().decode()
        if built_for != isa:
            raise RuntimeError(f"the {isa} kernels' library was built for {built_for}")
        self.isa = isa
        # True when the kernels do bfloat16 dot products (AVX512-BF16) for bfloat16 models
        self.bf16_dots = bool(lib.extend_bf16_dots())

    def runs_linear(self, num_rows: int, onednn_packed: bool) -> bool:
        """Whether skinny_linear, rather than oneDNN, should multiply `num_rows` rows by a weight
        (which oneDNN packed or not). Decode batches (up to NATIVE_LINEAR_ROWS rows) always:
        streaming the packed weight beats oneDNN on every variant, and the fused decode step
        (decode_step.c, which has only skinny_linear) then gives the layer loop's bits. Prefill
        rows on avx512 and avx2, whose tiles match oneDNN's matmuls at that instruction set or
        beat them. On generic, prefill rows go to oneDNN where it packed the weight; the
        backend packs nothing there and sends dense float32 rows past 16 to F.linear."""
        return num_rows <= NATIVE_LINEAR_ROWS or self.isa in TILED_PREFILL or not onednn_packed

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: DecodeLayout,
        scales: KVScales | None = None,
    ) -> torch.Tensor:
        """q (B, H, D), one query per request (the members of `layout`, in order); k/v_cache
        (num_slots, KV, D), with their `scales` when int8 codes -> (B, H, D). Shared runs of
        bfloat16 queries over a bfloat16 pool use bfloat16 dot products as `extend` does."""
        units, shared, own, member_row, slots = layout.pointers
        return _attend(
            self._fn["decode_attention"], q, k_cache, v_cache, scales,
            num_units=layout.num_units, units=units, shared=shared, own=own,
            member_row=member_row, slots=slots,
        )  # fmt: skip

    def extend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: ExtendLayout,
        scales: KVScales | None = None,
    ) -> torch.Tensor:
        """q (T, H, D): the new tokens of the requests in `layout`, back to back; k/v_cache
        (num_slots, KV, D), with their `scales` when int8 codes, already holding the new
        tokens' K/V -> (T, H, D). Rows of q that belong to no span of the layout come back
        uninitialised.

        bfloat16 queries over a bfloat16 pool use bfloat16 dot products where the CPU has them
        (`bf16_dots`): the probabilities are rounded to bfloat16 before P V."""
        spans, slots = layout.pointers
        return _attend(
            self._fn["extend_attention"], q, k_cache, v_cache, scales,
            num_spans=layout.num_spans, spans=spans, slots=slots,
        )  # fmt: skip

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h += delta (in place; none when delta is None), then return the RMS norm of h times
        weight. h, delta (T, hidden) and weight (hidden,): contiguous, one dtype (float32 or
        bfloat16); float32 arithmetic, a bfloat16 h rounded after the add."""
        tensors = [h, weight] if delta is None else [h, delta, weight]
        if any(t.dtype != h.dtype or not t.is_contiguous() for t in tensors):
            raise ValueError("add_rms_norm takes contiguous tensors of one dtype")
        if h.dtype not in KV_DTYPES or h.device.type != "cpu":
            raise ValueError(f"add_rms_norm runs on float32 or bfloat16 CPU tensors: {h.dtype}")
        if (
            h.dim() != 2
            or h.shape[1] != weight.shape[0]
            or (delta is not None and delta.shape != h.shape)
        ):
            raise ValueError(f"shapes: h {tuple(h.shape)}, weight {tuple(weight.shape)}")
        out = torch.empty_like(h)
        self._fn["add_rms_norm"](
            h=h.data_ptr(), delta=None if delta is None else delta.data_ptr(),
            weight=weight.data_ptr(), out=out.data_ptr(), num_tokens=h.shape[0],
            hidden=h.shape[1], eps=eps, bf16=int(h.dtype == torch.bfloat16),
            num_threads=torch.get_num_threads(),
        )  # fmt: skip
        return out

    def skinny_linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x (M, K) @ W^T, W packed by `pack_skinny` -> (M, N) in x's dtype (float32
        accumulation): up to SKINNY_MAX_ROWS rows stream W, more go through register tiles."""
        num_rows, k = x.shape
        n = packed.shape[0] * 16
        if x.dtype != packed.dtype or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("skinny_linear takes contiguous CPU rows of the packed weight's dtype")
        if num_rows < 1 or packed.numel() != n * k:
            raise ValueError(f"skinny_linear: x {tuple(x.shape)} against a packed ({n}, ?) weight")
        y = x.new_empty(num_rows, n)
        self._fn["skinny_linear"](
            x=x.data_ptr(), wp=packed.data_ptr(), y=y.data_ptr(), M=num_rows, N=n, K=k,
            bf16=int(x.dtype == torch.bfloat16), num_threads=torch.get_num_threads(),
        )  # fmt: skip
        return y

    def quant_linear(self, x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
        """x (M, K) float32 or bfloat16 @ W^T for a quantized W -> (M, N) in x's dtype: x
        quantized once per 32 inputs (the weight's mode), then every part of W multiplied."""
        num_rows, k = x.shape
        if x.dtype not in KV_DTYPES or x.device.type != "cpu" or k != weight.in_features:
            raise ValueError(f"quant_linear: x {tuple(x.shape)} {x.dtype} for {k} inputs")
        x = x.contiguous()
        fast = int(weight.mode == "fast")
        xq = torch.empty(num_rows, k, dtype=torch.int8 if fast else torch.int16)
        sx = torch.empty(num_rows, k // 32, dtype=torch.float32)
        sxb = torch.empty(num_rows, k // 32, dtype=torch.float32)
        bf16, threads = int(x.dtype == torch.bfloat16), torch.get_num_threads()
        self._fn["quantize_rows"](
            x=x.data_ptr(), M=num_rows, K=k, bf16=bf16, fast=fast, xq=xq.data_ptr(),
            sx=sx.data_ptr(), sxb=sxb.data_ptr(), num_threads=threads,
        )  # fmt: skip
        n = weight.out_features
        y = x.new_empty(num_rows, n)
        for part in weight.parts:
            self._fn["quant_matmul"](
                xq=xq.data_ptr(), sx=sx.data_ptr(), sxb=sxb.data_ptr(), M=num_rows, K=k,
                fast=fast, w=part.records.data_ptr(), N=part.out_features, bits=part.bits,
                sub=part.sub, has_min=int(part.has_min), kscale=int(part.kscale),
                y=y[:, part.start :].data_ptr(),
                y_stride=n, y_bf16=bf16, num_threads=threads,
            )  # fmt: skip
        return y

    def repack_blocks(self, blocks: FileBlocks, mode: str) -> torch.Tensor:
        """A file's blocks as records for `mode` (quant/layout.py's, made in one C pass):
        uint8 shaped layout.records_shape. Raises ValueError where the kernels cannot hold
        them (a shape off the record grid, a Q4_0 scale whose -8 d is not a half)."""
        from radixlm.model.quant import layout, record_format

        rows, cols = blocks.shape
        bits, sub, has_min, kscale = record_format(blocks.qtype)
        shape = layout.records_shape(rows, cols, bits, sub, has_min, kscale)
        out = torch.empty(shape, dtype=torch.uint8)
        raw = np.ascontiguousarray(blocks.raw)  # the file's mapping: read in place
        order = None
        if blocks.row_order is not None:
            order = np.ascontiguousarray(blocks.row_order, dtype=np.int64)
        try:
            self._fn["repack_blocks"](
                raw=raw.ctypes.data, qtype=int(blocks.qtype), rows=rows, cols=cols,
                row_order=None if order is None else order.ctypes.data,
                fast=int(mode == "fast"), records=out.data_ptr(),
                num_threads=torch.get_num_threads(),
            )  # fmt: skip
        except NativeError as e:
            raise ValueError(f"{blocks.qtype.name} blocks of shape {blocks.shape}: {e}") from e
        return out

    def quant_rows(
        self, ids: torch.Tensor, weight: QuantWeight, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows `ids` of a quantized weight as `dtype` (float32 or bfloat16): an embedding
        lookup, each value rounded as the gguf package dequantizes it."""
        if dtype not in KV_DTYPES:
            raise ValueError(f"quant_rows: {dtype} rows")
        ids = ids.to(torch.int64)
        out = torch.empty(ids.numel(), weight.in_features, dtype=dtype)
        for part in weight.parts:
            inside = (ids >= part.start) & (ids < part.start + part.out_features)
            rows = (ids[inside] - part.start).contiguous()
            got = torch.empty(rows.numel(), weight.in_features, dtype=dtype)
            self._fn["quant_rows"](
                w=part.records.data_ptr(), rows=rows.data_ptr(), num_rows=rows.numel(),
                N=part.out_features, K=weight.in_features, fast=int(weight.mode == "fast"),
                bits=part.bits, sub=part.sub, has_min=int(part.has_min),
                kscale=int(part.kscale), out=got.data_ptr(),
                out_bf16=int(dtype == torch.bfloat16),
            )  # fmt: skip
            out[inside] = got
        return out

    def decode_layers(
        self,
        h: torch.Tensor,
        weights: torch.Tensor,
        kv: torch.Tensor,
        kv_strides: tuple[int, int],
        final_norm: torch.Tensor,
        shape: DecoderShape,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        kv_dtype: torch.dtype,
        layout: DecodeLayout,
        quant: bool = False,
        scale_strides: tuple[int, int] = (0, 0),
    ) -> torch.Tensor:
        """A decode step through every decoder layer (csrc/decode_step.c): h (B, hidden), the
        embeddings, becomes the residual stream after the last layer (in place); returns the
        final norm of it. `weights` (num_layers, 6) int64 holds each layer's weight addresses
        (input norm, packed Wqkv, packed Wo, post-attention norm, packed Wgate_up, packed
        Wdown; with `quant`, the matmuls' quant descriptors: backend.FusedDecode), `kv`
        (num_layers, 4) its K and V pool views' and their scales' (KVPool.layer_addresses),
        whose slot and head strides (elements) are `kv_strides` (KVPool.kv_strides) and, for
        an int8 pool (kv_dtype), `scale_strides` (KVPool.scale_strides); rope as rope_store
        takes it; one token per request of `layout`."""
        num_rows = h.shape[0]
        if h.dtype not in KV_DTYPES or not h.is_contiguous() or kv_dtype not in POOL_DTYPES:
            raise ValueError("decode_layers runs float32 or bfloat16 models and pools")
        if kv_dtype == torch.int8 and (not bool(kv[:, 2:].all()) or 0 in scale_strides):
            raise ValueError("decode_layers: an int8 pool without its scales")
        tables = (weights.shape, kv.shape) == ((shape.num_layers, 6), (shape.num_layers, 4))
        if num_rows < 1 or not tables or {weights.dtype, kv.dtype} != {torch.int64}:
            raise ValueError(f"decode_layers: {num_rows} rows, tables {weights.shape} {kv.shape}")
        if layout.member_row.numel() != num_rows:
            raise ValueError("decode_layers: the layout's requests are not h's rows")
        d, slot, head = shape.head_dim, *kv_strides
        if (slot, head) != (shape.num_kv_heads * d, d) and (slot != d or head % d or head <= d):
            raise ValueError(
                f"decode_layers: K/V strides {kv_strides}, neither slot- nor head-major"
            )
        cos, sin = (t.contiguous() for t in rope)
        slots = out_slots.to(torch.int64).contiguous()
        bf16 = h.dtype == torch.bfloat16
        x = torch.empty_like(h)
        units, shared, own, member_row, slot_lists = layout.pointers
        self._fn["decode_layers"](
            h=h.data_ptr(), x=x.data_ptr(), layers=weights.data_ptr(), kv=kv.data_ptr(),
            slot_stride=slot, head_stride=head, scales_slot_stride=scale_strides[0],
            scales_head_stride=scale_strides[1], final_norm=final_norm.data_ptr(),
            num_layers=shape.num_layers, B=num_rows, hidden=shape.hidden,
            num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=d,
            inter=shape.intermediate, eps=shape.eps, bf16=int(bf16),
            kv_mode=_kv_mode(kv_dtype, h.dtype),
            scale=d**-0.5, cos=cos.data_ptr(), sin=sin.data_ptr(), out_slots=slots.data_ptr(),
            num_units=layout.num_units, units=units, shared=shared, own=own,
            member_row=member_row, slots=slot_lists, quant=int(quant),
            num_threads=torch.get_num_threads(),
        )  # fmt: skip
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up (T, 2 I), gate first -> (T, I), in gate_up's dtype
        (float32 or bfloat16; float32 arithmetic)."""
        if gate_up.dtype not in KV_DTYPES or gate_up.device.type != "cpu":
            raise ValueError(f"silu_mul runs on float32 or bfloat16 CPU tensors: {gate_up.dtype}")
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
            raise ValueError(f"silu_mul takes contiguous (T, 2 I) rows: {tuple(gate_up.shape)}")
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        act = gate_up.new_empty(num_tokens, inter)
        self._fn["silu_mul"](
            gate_up=gate_up.data_ptr(), act=act.data_ptr(), num_tokens=num_tokens, inter=inter,
            bf16=int(gate_up.dtype == torch.bfloat16), num_threads=torch.get_num_threads(),
        )  # fmt: skip
        return act

    def rope_store(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Rotate the new tokens' q and k and write k, v into the pool at `out_slots`: as
        float32 or bfloat16 values, or as int8 codes with their `scales` (kv_quant.py's
        arithmetic, in C).

        qkv (T, (H + 2 KV) * D) float32 or bfloat16, the stacked projection; rope: (cos,
        sign-folded sin), each (T, 1, D) float32 (rope.rope_cos_sin). Arithmetic is float32.
        Returns q (T, H, D) in qkv's dtype, rotated."""
        cos, sin = rope
        num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[1:]
        if qkv.dtype not in KV_DTYPES or cos.dtype != torch.float32 or qkv.stride(1) != 1:
            raise ValueError("rope_store takes float32 or bfloat16 rows of the qkv projection")
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv rows of {qkv.shape[1]} do not hold {num_heads} query heads")
        strides = kv_strides(k_cache, v_cache)
        k_scales, v_scales, scale_stride = _scales_of(k_cache, v_cache, scales)
        q = qkv.new_empty(num_tokens, num_heads, head_dim)
        slots = out_slots.to(torch.int64).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        self._fn["rope_store"](
            qkv=qkv.data_ptr(), num_tokens=num_tokens, row_stride=qkv.stride(0),
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            slot_stride=strides[0], head_stride=strides[1], cos=cos.data_ptr(),
            sin=sin.data_ptr(), out_slots=slots.data_ptr(), k=k_cache.data_ptr(),
            v=v_cache.data_ptr(), k_scales=k_scales, v_scales=v_scales,
            scales_slot_stride=scale_stride[0], scales_head_stride=scale_stride[1],
            kv_mode=_kv_mode(k_cache.dtype, qkv.dtype), qkv_bf16=int(qkv.dtype == torch.bfloat16),
            q_out=q.data_ptr(), num_threads=torch.get_num_threads(),
        )  # fmt: skip
        return q


def _kv_mode(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> int:
    """The kernels' kv_mode: 0 float32 K/V, 1 bfloat16 K/V, 2 bfloat16 K/V and queries (a
    bfloat16 model: the kernels may use bfloat16 dot products), 3 int8 codes with scales
    (float32 arithmetic), 4 int8 codes and bfloat16 queries (the decode row path's Q K^T in
    bfloat16 dot products where the CPU has them: the codes are exact in bfloat16)."""
    if kv_dtype == torch.int8:
        return 4 if q_dtype == torch.bfloat16 else 3
    return int(kv_dtype == torch.bfloat16) * (2 if q_dtype == torch.bfloat16 else 1)


def _scales_of(
    k_cache: torch.Tensor, v_cache: torch.Tensor, scales: KVScales | None
) -> tuple[int | None, int | None, tuple[int, int]]:
    """(K scales' address, V scales' address, their strides) for a pool layer: None and (0, 0)
    for float K/V; ValueError for a dtype the kernels do not read, or int8 without scales."""
    if k_cache.dtype not in POOL_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the native kernels read float32, bfloat16 or int8 K/V: {k_cache.dtype}")
    if k_cache.dtype != torch.int8:
        return None, None, (0, 0)
    if scales is None:
        raise ValueError("int8 K/V need their scales")
    strides = scale_strides(k_cache, scales.k, scales.v)
    return scales.k.data_ptr(), scales.v.data_ptr(), strides


def _attend(
    fn: NativeFunction,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: KVScales | None,
    **layout: int,
) -> torch.Tensor:
    """Call an attention kernel (decode or extend: same leading arguments) -> out in q's dtype
    (kv_mode: `_kv_mode`)."""
    k_scales, v_scales, scale_stride = _scales_of(k_cache, v_cache, scales)
    strides = kv_strides(k_cache, v_cache)
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        raise ValueError("the native kernels run on CPU tensors")
    num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    if head_dim % 16 != 0 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}: {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    q32 = q.to(torch.float32).contiguous()
    out = torch.empty_like(q32)
    fn(
        q=q32.data_ptr(), k=k_cache.data_ptr(), v=v_cache.data_ptr(), k_scales=k_scales,
        v_scales=v_scales, out=out.data_ptr(), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, slot_stride=strides[0], head_stride=strides[1],
        scales_slot_stride=scale_stride[0], scales_head_stride=scale_stride[1],
        kv_mode=_kv_mode(k_cache.dtype, q.dtype), scale=head_dim**-0.5,
        num_threads=torch.get_num_threads(), **layout,
    )  # fmt: skip
    return out.to(q.dtype)
