"""The quantized kernels' weight layout: Blocks repacked once at load into column-interleaved
records that csrc/quant_linear.c streams.

A weight of N outputs and K inputs is cut into groups of 8 outputs (columns) and blocks of 32
inputs; record (g, b) holds group g's block b and the records of a group follow each other, so
one group's weights are one stream:

    record = [ q: 8 cols x 32 inputs, 4, 5, 6 or 8 bits (128, 160, 192, 256 bytes) ] [ scales ]

and the scales in one of two forms, each what the file holds (so a group's stream is the
file's bytes, or near them) and exactly what its dequantization computes:

    f16   [ scales: sub x 8 fp16 ] [ mins: 8 fp16, where the type has them ]   Q4_0/Q4_1/Q8_0
    k     [ sc: sub x 8 int8 ] [ mc: 8 int8, where the type has mins ]         Q4_K/Q5_K/Q6_K

The K types' d and dmin belong to the file's super-block of 256 inputs: they come once per 8
records, before them, as that super-block's factors (scale = d * sc, min = -dmin * mc: products
exact in float32):

    factors = [ d: 8 fp16 ] [ -dmin: 8 fp16, where the type has mins ]
    f16 types: records (N/8, K/32, record_bytes)
    K types:   (N/8, K/256, factor_bytes + 8 * record_bytes): [ factors ] [ 8 records ]

so a Q4_K super-block of a column streams 148 bytes against the file's 144, a Q6_K one 210.

Inside q, the order is the one the kernel's unpacking produces without shuffles (x86's byte
unpacks and sign extensions work inside 128-bit lanes), so that every 256-bit vector it makes
holds the 8 columns side by side:

    exact (int16 activations)  vector s = 16 int16, lanes (2j, 2j+1) = column j, inputs 2s, 2s+1
                               (vpmaddwd: one int32 lane per column, two inputs at a time)
    fast (int8 activations)    vector s = 32 bytes, lanes 4j..4j+3 = column j, inputs 4s..4s+3
                               (vpmaddubsw + vpmaddwd, or vpdpbusd: four inputs at a time)

4-bit values come 64 to a 32-byte load: its low nibbles make one vector (fast) or two (exact,
the low and high halves of a byte unpack), its high nibbles the next. 5- and 6-bit values
(Q5_K, Q6_K + 32) keep their low 4 bits in that nibble layout and their high bits in a plane
after it: the nibbles form 8 byte vectors e (e = 2 * chunk + high nibble) of 32 lanes, and
vector e's h = bits - 4 high bits lie at plane byte 32 * (e * h // 8) + lane, bit (e * h) % 8,
so a plane vector completes 8 / h nibble vectors lane for lane with a shift and a mask.
`_POSITIONS` maps (column, input) to where its bits lie; packing and unpacking both read it, and
csrc/quant_record.h spells the same layout for the kernels.
"""

from __future__ import annotations

import numpy as np

from radixlm.model.quant.blocks import Blocks

GROUP = 8  # outputs per record
BLOCK = 32  # inputs per record
MODES = ("exact", "fast")


def _exact_positions(bits: int) -> tuple[np.ndarray, np.ndarray]:
    byte = np.zeros((GROUP, BLOCK), dtype=np.int64)
    shift = np.zeros((GROUP, BLOCK), dtype=np.int64)
    for s in range(16):  # the 16 int16 vectors of a block
        for lane in range(16):
            j, k = lane // 2, 2 * s + lane % 2
            if bits == 8:  # vpmovsxbw of 16 bytes
                byte[j, k] = 16 * s + lane
                continue
            chunk, u = divmod(s, 4)  # 32-byte load; u: lo/hi nibble x unpacklo/hi
            high_nibble, unpack_high = divmod(u, 2)
            if not unpack_high:  # vpunpcklbw: bytes 0..7, then 16..23
                within = lane if lane < 8 else lane + 8
            else:  # vpunpckhbw: bytes 8..15, then 24..31
                within = lane + 8 if lane < 8 else lane + 16
            byte[j, k] = 32 * chunk + within
            shift[j, k] = 4 * high_nibble
    return byte, shift


def _fast_positions(bits: int) -> tuple[np.ndarray, np.ndarray]:
    byte = np.zeros((GROUP, BLOCK), dtype=np.int64)
    shift = np.zeros((GROUP, BLOCK), dtype=np.int64)
    for s in range(8):  # the 8 byte vectors of a block
        for pos in range(32):
            j, k = pos // 4, 4 * s + pos % 4
            if bits == 8:
                byte[j, k] = 32 * s + pos
            else:
                chunk, high_nibble = divmod(s, 2)
                byte[j, k], shift[j, k] = 32 * chunk + pos, 4 * high_nibble
    return byte, shift


_POSITIONS = {
    (mode, bits): (_exact_positions if mode == "exact" else _fast_positions)(bits)
    for mode in MODES
    for bits in (4, 8)
}
for _mode in MODES:  # 5- and 6-bit values' low nibbles lie as 4-bit values do
    _POSITIONS[(_mode, 5)] = _POSITIONS[(_mode, 6)] = _POSITIONS[(_mode, 4)]
NIBBLE_BYTES = GROUP * BLOCK // 2  # the nibble layout's bytes; a plane follows for 5 and 6 bits


def _plane_positions(mode: str, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (column, input): the byte of q and the bit where its high bits (bits - 4 of them)
    start, for 5- and 6-bit values (the module docstring draws it)."""
    byte, shift = _POSITIONS[(mode, bits)]
    h = bits - 4
    e = 2 * (byte // 32) + shift // 4
    return NIBBLE_BYTES + 32 * (e * h // 8) + byte % 32, (e * h) % 8


def _sources(mode: str, bits: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Per byte of a record's q: the (column * 32 + input) whose bits it holds (the low nibble
    and the high one for 4-bit values): `_POSITIONS` inverted, for packing by gathers."""
    byte, shift = _POSITIONS[(mode, bits)]
    qbytes = GROUP * BLOCK * (8 if bits == 8 else 4) // 8  # the int8s, or the nibbles
    low = np.zeros(qbytes, dtype=np.int64)
    high = np.zeros(qbytes, dtype=np.int64)
    flat = np.arange(GROUP * BLOCK).reshape(GROUP, BLOCK)
    low[byte[shift == 0]] = flat[shift == 0]
    high[byte[shift == 4]] = flat[shift == 4]
    return low, (high if bits < 8 else None)


_SOURCES = {key: _sources(*key) for key in _POSITIONS}
_PLANES = {(mode, bits): _plane_positions(mode, bits) for mode in MODES for bits in (5, 6)}


SUPER = 8  # records per K-type super-block (256 inputs): one d and -dmin per column


def factor_bytes(has_min: bool, kscale: bool) -> int:
    """A K type's super-block factors: d (and -dmin) for 8 columns, fp16; 0 for the others."""
    return (2 * GROUP + (2 * GROUP if has_min else 0)) if kscale else 0


def scale_bytes(sub: int, has_min: bool, kscale: bool) -> int:
    if kscale:
        return GROUP * sub + (GROUP if has_min else 0)
    return 2 * GROUP * sub + (2 * GROUP if has_min else 0)


def record_bytes(bits: int, sub: int, has_min: bool, kscale: bool) -> int:
    return GROUP * BLOCK * bits // 8 + scale_bytes(sub, has_min, kscale)


def records_shape(
    rows: int, cols: int, bits: int, sub: int, has_min: bool, kscale: bool
) -> tuple[int, int, int]:
    """The uint8 array a (rows, cols) weight's records fill: per group of 8 rows, its blocks
    (f16 types) or its super-blocks with their factors (K types)."""
    rec = record_bytes(bits, sub, has_min, kscale)
    if kscale:
        return rows // GROUP, cols // (SUPER * BLOCK), factor_bytes(has_min, kscale) + SUPER * rec
    return rows // GROUP, cols // BLOCK, rec


def pack(blocks: Blocks, mode: str) -> np.ndarray:
    """Blocks of an (N, K) weight -> uint8 records for `mode`, shaped `records_shape`.
    Raises ValueError for an f16-form type whose scales or mins are not fp16 values (a Q4_0
    scale so large that -8 d overflows fp16)."""
    n, k = blocks.q.shape
    if n % GROUP or k % BLOCK:
        raise ValueError(f"a ({n}, {k}) weight is not whole groups of {GROUP} x {BLOCK}")
    groups, nblocks, bits, sub = n // GROUP, k // BLOCK, blocks.bits, blocks.sub
    # (groups, blocks, 8 columns x 32 inputs) of the stored bits, gathered byte by byte
    stored = blocks.q + 32 if bits == 6 else blocks.q  # Q6_K's values stored + 32: 0..63
    columns = stored.astype(np.int8).view(np.uint8).reshape(groups, GROUP, nblocks, BLOCK)
    q = columns.transpose(0, 2, 1, 3).reshape(groups, nblocks, GROUP * BLOCK)
    low, high = _SOURCES[(mode, bits)]
    qs = np.take(q, low, axis=2)
    if high is not None:
        nibbles = np.uint8(0x0F)
        qs = (qs & nibbles) | ((np.take(q, high, axis=2) & nibbles) << np.uint8(4))
    if bits in (5, 6):  # the high bits' plane: each value's (q >> 4) at its byte and bit
        at, bit = _PLANES[(mode, bits)]
        plane = np.zeros((groups, nblocks, GROUP * BLOCK * bits // 8 - NIBBLE_BYTES), np.uint8)
        highs = (q >> np.uint8(4)) << bit.reshape(-1).astype(np.uint8)  # (g, b, 256)
        for i, target in enumerate(at.reshape(-1) - NIBBLE_BYTES):  # 256 (column, input)s
            plane[:, :, target] |= highs[:, :, i]
        qs = np.concatenate([qs, plane], axis=2)

    def per_record(values: np.ndarray, per_block: int, dtype: type) -> np.ndarray:
        """(N, nblocks * per_block) values -> (groups, nblocks, per_block * 8 columns) bytes."""
        v = values.reshape(groups, GROUP, nblocks, per_block).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(v, dtype=dtype).view(np.uint8).reshape(groups, nblocks, -1)

    f = blocks.factors
    if f is None:
        parts = [qs, per_record(_as_halves(blocks.scales, blocks.source), sub, np.float16)]
        if blocks.mins is not None:
            parts.append(per_record(_as_halves(blocks.mins, blocks.source), 1, np.float16))
        return np.ascontiguousarray(np.concatenate(parts, axis=2))
    if nblocks % SUPER:
        raise ValueError(f"{blocks.source}: {k} inputs are not whole super-blocks of 256")
    parts = [qs, per_record(f.sc, sub, np.int8)]
    # the factors, per super-block: f.d and f.nd repeat the super-block's value per 32 inputs
    factors = [f.d[:, ::SUPER]]
    if f.nd is not None and f.mc is not None:
        parts.append(per_record(f.mc, 1, np.int8))
        factors.append(f.nd[:, ::SUPER])
    supers = nblocks // SUPER
    records = np.concatenate(parts, axis=2).reshape(groups, supers, -1)
    heads = [
        np.ascontiguousarray(v.reshape(groups, GROUP, supers).transpose(0, 2, 1), np.float16)
        .view(np.uint8)
        .reshape(groups, supers, 2 * GROUP)
        for v in factors
    ]
    return np.ascontiguousarray(np.concatenate([*heads, records], axis=2))


def _as_halves(values: np.ndarray, source: str) -> np.ndarray:
    halves = values.astype(np.float16)
    if not np.array_equal(halves.astype(np.float32), values):
        raise ValueError(f"{source} scales that are not fp16 values")
    return halves


def unpack_rows(
    records: np.ndarray, rows: np.ndarray, bits: int, sub: int, has_min: bool, kscale: bool,
    mode: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:  # fmt: skip
    """The integer values, scales and mins of output rows `rows` (the inverse of `pack`, for
    those rows): q (R, K) int16, scales (R, K/32, sub) float32, mins (R, K/32) float32 or None."""
    qbytes = GROUP * BLOCK * bits // 8
    byte, shift = _POSITIONS[(mode, bits)]
    group, lane = np.divmod(rows, GROUP)
    rec = records[group]  # (R, K/32, record), or (R, K/256, factors + 8 records)
    heads = None
    if kscale:  # the super-blocks' factors apart, and their records as (R, K/32, record)
        fb = factor_bytes(has_min, kscale)
        heads = np.repeat(rec[:, :, :fb], SUPER, axis=1)  # (R, K/32, factors)
        rec = rec[:, :, fb:].reshape(len(rows), rec.shape[1] * SUPER, -1)
    nblocks = rec.shape[1]
    where = np.repeat(byte[lane][:, None, :], nblocks, axis=1)  # (R, K/32, 32)
    mine = np.take_along_axis(rec[:, :, :qbytes], where, axis=2)
    values = (mine >> shift[lane][:, None, :].astype(np.uint8)).astype(np.uint8)
    low: np.ndarray = values.view(np.int8) if bits == 8 else values & np.uint8(0x0F)
    q = low.astype(np.int16)
    if bits in (5, 6):
        plane_at, bit = _PLANES[(mode, bits)]
        where = np.repeat(plane_at[lane][:, None, :], nblocks, axis=1)
        highs = np.take_along_axis(rec[:, :, :qbytes], where, axis=2)
        highs = (highs >> bit[lane][:, None, :].astype(np.uint8)) & np.uint8((1 << (bits - 4)) - 1)
        q = q | (highs.astype(np.int16) << 4)
        if bits == 6:
            q = q - 32
    r = np.arange(len(rows))

    def field(start: int, per_block: int, dtype: type, of: np.ndarray | None = None) -> np.ndarray:
        """Bytes [start, ...) of each record's scales (or of `of`, its factors) as
        (R, K/32, per_block) values of `dtype`."""
        size = np.dtype(dtype).itemsize * GROUP * per_block
        where = rec[:, :, qbytes:] if of is None else of
        raw = np.ascontiguousarray(where[:, :, start : start + size])
        values: np.ndarray = raw.view(dtype).reshape(-1, nblocks, per_block, GROUP)[r, :, :, lane]
        return values.astype(np.float32)

    mins = None
    if heads is not None:  # the products the kernels form, exact in float32
        scales = field(0, 1, np.float16, heads) * field(0, sub, np.int8)
        if has_min:
            nd = field(2 * GROUP, 1, np.float16, heads)
            mins = (nd * field(GROUP * sub, 1, np.int8))[:, :, 0]
    else:
        scales = field(0, sub, np.float16)
        if has_min:
            mins = field(2 * GROUP * sub, 1, np.float16)[:, :, 0]
    return q.reshape(len(rows), -1), scales, mins
