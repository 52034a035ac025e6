"""The int8 K/V format of a KV pool (`--kv-dtype int8`): every row, one slot's one kv head of
head_dim values, is stored as head_dim int8 codes and one bfloat16 scale.

    scale = max|x| * (1/127), rounded *up* to a bfloat16    so no |x| / scale exceeds 127
    code  = round(x * (1 / scale)), ties to even, clamped to [-127, 127]
    value = code * scale                                    exact in float32 (8 + 8 bits)

so a stored value is within scale / 2 <= max|x| / 254 * (1 + 2^-7) of what was written. A row
of zeros gets scale 0 and codes 0. A row costs head_dim + 2 bytes against 2 head_dim in
bfloat16: 66 against 128 at head_dim 64, 1.94x the tokens in the same bytes.

Why a bfloat16 scale: two bytes where a float32 costs four (1.94x rather than 1.88x), the
range of a float32 (no row is too small or too large for its scale, as with float16), and
code * scale exact in float32, so every reader (the native kernels, the PyTorch path) sees the
same values. The scales live in arrays of their own beside the codes (KVPool), so a row of
codes stays a whole cache line at head_dim 64 (the layout measured: docs/kernels.md).

This module is the PyTorch arithmetic; csrc/rope_store.c's quantize_row does the same steps in
the same order in float32, and the tests hold the two to the same bits.
"""

from __future__ import annotations

import torch

CODE_MAX = 127
# the float32 constant both sides multiply by (C folds 1.0f / 127.0f to the same number)
_INV_CODE_MAX = torch.tensor(1.0 / CODE_MAX, dtype=torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> (codes (..., D) int8, scales (...) bfloat16), one scale per row."""
    x = x.float()
    raw = x.abs().amax(dim=-1) * _INV_CODE_MAX  # (...) float32, >= 0
    bits = (raw.view(torch.int32) + 0xFFFF) & -0x10000  # up to the next bfloat16
    scale = bits.view(torch.float32)
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    codes = torch.round(x * inv.unsqueeze(-1)).clamp_(-CODE_MAX, CODE_MAX).to(torch.int8)
    return codes, scale.to(torch.bfloat16)  # exact: scale is a bfloat16 already


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes (..., D) int8 and scales (...) -> the values (..., D) in `dtype` (float32: exact)."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)
