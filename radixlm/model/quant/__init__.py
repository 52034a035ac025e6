"""Quantized weights: GGUF blocks kept as integers and multiplied by integer kernels.

    blocks.py     GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K bytes -> integer values, scales, mins
    layout.py     those repacked into the column-interleaved records the kernels stream
    reference.py  the kernels' arithmetic in PyTorch (the reference the tests hold them to)

A weight format, not a model: a `Linear` holds either a float weight or a `QuantWeight`, and
the backend multiplies either (backend.matmul_route). Two numerics, chosen once per model:

    exact   activations quantized to int16 per 32 inputs: within float rounding of the float
            model on the dequantized weights (the default; the parity tests hold)
    fast    int8 activations per 32 inputs (llama.cpp's Q8 numerics): twice the integer rate
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixlm.model.quant import layout
from radixlm.model.quant.blocks import (
    QUANT_TYPES,
    Blocks,
    FileBlocks,
    decode,
    quantize_q8_0,
    record_format,
)  # fmt: skip
from radixlm.model.quant.layout import MODES

__all__ = [
    "MODES", "QUANT_TYPES", "Blocks", "FileBlocks", "QuantWeight", "Repack", "decode",
    "quantize_q8_0", "record_format",
]  # fmt: skip
# file blocks + mode -> records, in C (native.Kernels.repack_blocks)
Repack = Callable[[FileBlocks, str], torch.Tensor]


@dataclass(frozen=True)
class QuantPart:
    """One weight's records (layout.pack), for outputs [start, start + out_features)."""

    records: torch.Tensor  # uint8, layout.records_shape: (N/8, K/32 or K/256, bytes)
    out_features: int
    start: int
    bits: int
    sub: int
    has_min: bool
    kscale: bool  # scales in the K types' factored form (layout.py)
    source: str  # the GGUF type

    def dequantize_rows(self, rows: np.ndarray, mode: str) -> torch.Tensor:
        """Float32 rows (outputs) of this part's weight, (R, K)."""
        q, scales, mins = layout.unpack_rows(
            self.records.numpy(), rows, self.bits, self.sub, self.has_min, self.kscale, mode
        )
        num_rows, k = q.shape
        w = q.astype(np.float32).reshape(num_rows, k // 32, self.sub, 32 // self.sub)
        w = (w * scales[:, :, :, None]).reshape(num_rows, k // 32, 32)
        if mins is not None:
            w = w + mins[:, :, None]
        return torch.from_numpy(w.reshape(num_rows, k))


class QuantWeight:
    """An (out, in) weight as quantized records, in one or more parts stacked along the outputs
    (a fused q/k/v or gate/up projection whose parts the file stores in different types).
    Activations are quantized once per call and shared by the parts."""

    def __init__(self, in_features: int, mode: str):
        if mode not in MODES:
            raise ValueError(f"quantized numerics must be one of {', '.join(MODES)}: {mode!r}")
        if in_features % layout.BLOCK:
            raise ValueError(f"{in_features} inputs are not whole blocks of {layout.BLOCK}")
        self.in_features = in_features
        self.mode = mode
        self.parts: list[QuantPart] = []

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.records.numel() for p in self.parts)

    def add(self, blocks: Blocks | FileBlocks, start: int, repack: Repack | None = None) -> None:
        """Blocks of outputs [start, start + rows): packed for this weight's mode, by `repack`
        (the C repacker) where given and the blocks are the file's, else in numpy."""
        if isinstance(blocks, FileBlocks) and repack is not None:
            (rows, cols), source = blocks.shape, blocks.qtype.name
            bits, sub, has_min, kscale = record_format(blocks.qtype)
            self._check(cols)
            records = repack(blocks, self.mode)
        else:
            if isinstance(blocks, FileBlocks):
                blocks = blocks.decode()
            rows, cols = blocks.q.shape
            self._check(cols)
            records = torch.from_numpy(layout.pack(blocks, self.mode))
            bits, sub, source = blocks.bits, blocks.sub, blocks.source
            has_min, kscale = blocks.mins is not None, blocks.factors is not None
        part = QuantPart(records, rows, start, bits, sub, has_min, kscale, source)
        self.parts.append(part)
        self.parts.sort(key=lambda p: p.start)

    def _check(self, cols: int) -> None:
        if cols != self.in_features:
            raise ValueError(f"a part of {cols} inputs in a weight of {self.in_features}")

    def complete(self, out_features: int) -> bool:
        """Whether the parts cover outputs 0 .. out_features - 1 exactly."""
        end = 0
        for part in self.parts:
            if part.start != end:
                return False
            end += part.out_features
        return end == out_features

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Float32 rows of the weight (an embedding lookup): (len(rows), in_features)."""
        ids = rows.cpu().numpy().astype(np.int64)
        out = torch.empty(len(ids), self.in_features, dtype=torch.float32)
        for part in self.parts:
            inside = (ids >= part.start) & (ids < part.start + part.out_features)
            if inside.any():
                out[torch.from_numpy(inside)] = part.dequantize_rows(
                    ids[inside] - part.start, self.mode
                )
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole float32 weight (out, in)."""
        return self.dequantize_rows(torch.arange(self.out_features))
