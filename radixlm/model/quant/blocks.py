"""GGUF quantized blocks -> integer values with their per-block scales and mins.

Every type the quantized kernels run is written as `w = scale * q + min`, with q small integers
and (scale, min) per group of 16 or 32 inputs of one output row. The GGUF types decode to:

    type   q (stored as)           scale per      min per 32        from the block's
    Q4_0   0..15   (4-bit)         32             -8 * d            fp16 d
    Q4_1   0..15   (4-bit)         32             m                 fp16 d, m
    Q4_K   0..15   (4-bit)         32             -dmin * mc        fp16 d, dmin; 6-bit sc, mc
    Q5_K   0..31   (5-bit)         32             -dmin * mc        as Q4_K, plus a high bit
    Q6_K   -32..31 (6-bit, + 32)   16 (2 per 32)  none              fp16 d; int8 sc per 16
    Q8_0   -128..127 (8-bit)       32             none              fp16 d

Scales are float32 products of the block's fp16 scale and its small integer sub-scale, exact in
float32 (11 + 8 bits), so `scale * q + min` is what the gguf package's dequantization computes.
The K types keep those two factors (`Factors`) so the kernels' records hold the file's bytes
rather than float32 products; the others' scales and mins are fp16 values themselves.
The block layouts are ggml's (ggml-common.h); `decode` is checked against gguf.quants.dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # kept as integer blocks
QK_K = 256


@dataclass(frozen=True)
class Factors:
    """A K type's scales as the file factors them: scale = d * sc per group of 32 // sub
    inputs, min = nd * mc per 32 (nd = -dmin), each product exact in float32."""

    d: np.ndarray  # (rows, cols // 32) float16: the super-block's d, repeated per 32 inputs
    sc: np.ndarray  # (rows, cols // group) int8
    nd: np.ndarray | None  # (rows, cols // 32) float16, or None (no offset)
    mc: np.ndarray | None  # (rows, cols // 32) int8

    def take_rows(self, order: np.ndarray) -> Factors:
        nd = None if self.nd is None else self.nd[order]
        mc = None if self.mc is None else self.mc[order]
        return Factors(self.d[order], self.sc[order], nd, mc)


@dataclass(frozen=True)
class Blocks:
    """A (rows, cols) weight as integers: w[r, k] = scales[r, k // group] * q[r, k] + min."""

    q: np.ndarray  # (rows, cols) int8, or uint8 for 4-bit values (0..15)
    scales: np.ndarray  # (rows, cols // group) float32; group = 32 // sub
    mins: np.ndarray | None  # (rows, cols // 32) float32, or None (no offset)
    bits: int  # 4, 5, 6 or 8: how the kernels store q (layout.py)
    sub: int  # scales per 32 inputs: 1, or 2 (Q6_K's groups of 16)
    source: str  # the GGUF type name
    factors: Factors | None = None  # the K types' factored scales; else scales are fp16 values

    def take_rows(self, order: np.ndarray) -> Blocks:
        """These blocks with their rows (outputs) in `order`."""
        mins = None if self.mins is None else self.mins[order]
        factors = None if self.factors is None else self.factors.take_rows(order)
        return Blocks(
            self.q[order], self.scales[order], mins, self.bits, self.sub, self.source, factors
        )

    def dequantize(self) -> np.ndarray:
        """The float32 weight (what gguf.quants.dequantize gives)."""
        rows, cols = self.q.shape
        group = 32 // self.sub
        w = self.q.astype(np.float32).reshape(rows, cols // group, group)
        w = w * self.scales[:, :, None]
        w = w.reshape(rows, cols // 32, 32)
        if self.mins is not None:
            w = w + self.mins[:, :, None]
        return w.reshape(rows, cols)


@dataclass(frozen=True)
class FileBlocks:
    """A tensor's blocks as the file stores them, not decoded yet: csrc/quant_repack.c turns
    them into records in one pass; `decode` gives the Blocks the Python path packs."""

    raw: np.ndarray  # uint8, the tensor's bytes: rows of blocks
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, int]  # (rows, cols)
    row_order: np.ndarray | None = None  # the file row of each output row (None: the same)

    def decode(self) -> Blocks:
        blocks = decode(self.raw, self.qtype, self.shape)
        return blocks if self.row_order is None else blocks.take_rows(self.row_order)


def record_format(qtype: gguf.GGMLQuantizationType) -> tuple[int, int, bool, bool]:
    """(bits, sub, has_min, kscale): how the kernels store a type (the table above)."""
    if qtype.name not in QUANT_TYPES:
        raise ValueError(f"{qtype.name} is not a type the quantized kernels run")
    bits = {T.Q8_0: 8, T.Q5_K: 5, T.Q6_K: 6}.get(qtype, 4)
    kscale = qtype in (T.Q4_K, T.Q5_K, T.Q6_K)
    return bits, 2 if qtype == T.Q6_K else 1, qtype not in (T.Q8_0, T.Q6_K), kscale


def decode(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> Blocks:
    """raw: the tensor's bytes as the file holds them, rows of blocks; shape (rows, cols)."""
    rows, cols = shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{qtype.name}: {cols} columns are not whole blocks of {block_size}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, type_size)
    n = blocks.shape[0]
    if n * block_size != rows * cols:
        raise ValueError(f"{qtype.name}: {n} blocks do not hold a ({rows}, {cols}) tensor")
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        raise ValueError(f"{qtype.name} is not a type the quantized kernels run")
    q, scales, mins, bits, sub, factors = decoder(blocks)
    per_row = cols // 32
    if factors is not None:  # per super-block / per group -> per row of groups
        d, sc, nd, mc = factors
        factors = Factors(
            np.repeat(d, 8, axis=1).reshape(rows, per_row),
            sc.reshape(rows, per_row * sub).astype(np.int8),
            None if nd is None else np.repeat(nd, 8, axis=1).reshape(rows, per_row),
            None if mc is None else mc.reshape(rows, per_row).astype(np.int8),
        )
    return Blocks(
        q.reshape(rows, cols),
        scales.reshape(rows, per_row * sub).astype(np.float32),
        None if mins is None else mins.reshape(rows, per_row).astype(np.float32),
        bits, sub, qtype.name, factors,
    )  # fmt: skip


def _f16(column: np.ndarray) -> np.ndarray:
    return column.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, width: int) -> np.ndarray:
    """ggml's nibble order: each run of `width` bytes holds `width` values in its low nibbles,
    then the next `width` in its high ones."""
    split = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(n, -1)


def _q4_0(b: np.ndarray) -> tuple:
    n = b.shape[0]
    d = _f16(b[:, :2])  # (n, 1)
    return _nibbles(b[:, 2:], n, 16), d, -8 * d, 4, 1, None


def _q4_1(b: np.ndarray) -> tuple:
    n = b.shape[0]
    return _nibbles(b[:, 4:], n, 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 4, 1, None


def _q8_0(b: np.ndarray) -> tuple:
    return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None, 8, 1, None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Q4_K / Q5_K: per 32 inputs, scale d * sc and min -dmin * mc (6-bit sc, mc), and those
    factors: (d, sc, -dmin, mc)."""
    d16, dmin16 = b[:, :2].copy().view(np.float16), b[:, 2:4].copy().view(np.float16)
    sc, mc = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    scales, mins = d * sc.astype(np.float32), -(dmin * mc.astype(np.float32))
    return scales, mins, (d16, sc, -dmin16, mc)


def _q4_k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    scales, mins, factors = _k_scales(b)
    return _nibbles(b[:, 16:], n, 32), scales, mins, 4, 1, factors


def _q5_k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    scales, mins, factors = _k_scales(b)
    low = _nibbles(b[:, 48:], n, 32)  # (n, 256)
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (qh & np.uint8(1)).reshape(n, 256)  # bit i of byte l: input 32 i + l
    return (low | (high << np.uint8(4))).astype(np.int8), scales, mins, 5, 1, factors


def _q6_k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8)  # (n, 16)
    d16 = b[:, 208:210].copy().view(np.float16)
    low = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(n, 2, 4, 32)
    high = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(3)).reshape(n, 2, 4, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = d16.astype(np.float32) * sc.astype(np.float32)
    return q.reshape(n, 256), scales, None, 6, 2, (d16, sc, None, None)


_DECODERS = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}  # fmt: skip


def quantize_q8_0(weight: np.ndarray) -> Blocks:
    """A float (rows, cols) weight as Q8_0 blocks (per 32 inputs: d = max |w| / 127, rounded
    to fp16 as ggml does): `--quantize q8_0` for float checkpoints."""
    rows, cols = weight.shape
    raw = gguf.quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), T.Q8_0)
    return decode(raw, T.Q8_0, (rows, cols))
