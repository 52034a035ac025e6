"""The quantized kernels' arithmetic in PyTorch: activations quantized per 32 inputs, integer
dot products, then per block `dot_h * (scale_h * sx) + min * sxb` summed over the blocks. The
kernels add in float32 with fused multiply-adds, block by block; this sums in float64, so the
two agree to float32 rounding. Slow; for tests and for a quantized model without kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from radixlm.model.quant import layout

if TYPE_CHECKING:
    from radixlm.model.quant import QuantPart, QuantWeight

QMAX = {"exact": 32767, "fast": 127}  # the activations' integer range per mode


def quantize_activations(
    x: torch.Tensor, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) -> xq (M, K) int64 values, sx (M, K/32) and sxb (M, K/32) float32: per block of
    32, xq = round(x * (QMAX / max|x|)), sx = max|x| * (1 / QMAX), sxb = sx * sum(xq)."""
    qmax = QMAX[mode]
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)  # (M, K/32)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv[..., None]).clamp(-qmax, qmax).to(torch.int64)
    sx = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)
    return xq.reshape(m, k), sx, sx * xq.sum(dim=-1).float()


def linear(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype."""
    xq, sx, sxb = quantize_activations(x, weight.mode)
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    for part in weight.parts:
        end = part.start + part.out_features
        out[:, part.start : end] = _part(xq, sx, sxb, part, weight.mode)
    return out.to(x.dtype)


def _part(
    xq: torch.Tensor, sx: torch.Tensor, sxb: torch.Tensor, part: QuantPart, mode: str
) -> torch.Tensor:
    rows = np.arange(part.out_features)
    q, scales, mins = layout.unpack_rows(
        part.records.numpy(), rows, part.bits, part.sub, part.has_min, part.kscale, mode
    )
    m, k = xq.shape
    n, sub = part.out_features, part.sub
    group = 32 // sub
    # integer dot products per (row, output, block, sub-block), exact in float64
    xs = xq.double().reshape(m, k // group, group)
    ws = torch.from_numpy(q).double().reshape(n, k // group, group)
    dots = torch.einsum("mbg,nbg->mnb", xs, ws).reshape(m, n, k // 32, sub)
    d = torch.from_numpy(scales)  # (N, K/32, sub) float32
    dsx = (d[None] * sx[:, None, :, None]).double()  # (M, N, K/32, sub): float32 products
    t = (dots * dsx).sum(dim=-1)  # (M, N, K/32)
    if mins is not None:
        t = t + torch.from_numpy(mins).double()[None] * sxb.double()[:, None, :]
    return t.sum(dim=-1).float()
