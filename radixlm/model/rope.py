"""Rotary position embeddings in the Hugging Face "rotate half" layout, with Llama 3 scaling.

Head dims are split in halves (x1, x2) that rotate together: (x1, x2) -> (x1 cos - x2 sin,
x2 cos + x1 sin). cos/sin are computed from the positions once per forward and shared by all
layers; nothing is tabulated up to the context length (131K positions would cost 100+ MB).
"""

from __future__ import annotations

import math

import torch

from radixlm.model.arch import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The (head_dim/2,) float32 angular frequencies, after the config's scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin, each (T, 1, head_dim), for `apply_rope`."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    cos, sin = angles.cos(), angles.sin()
    # sin carries the minus sign of the first half, so rotation is x*cos + swap_halves(x)*sin.
    cos = torch.cat([cos, cos], dim=-1)[:, None, :].to(dtype)  # (T, 1, head_dim)
    sin = torch.cat([-sin, sin], dim=-1)[:, None, :].to(dtype)  # (T, 1, head_dim)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, head_dim) by its tokens' angles; returns a new contiguous tensor."""
    swapped = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, sin)


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: slow the low frequencies by `factor`, keep the high ones, blend between.

    Wavelengths longer than original_max_position/low_freq_factor are divided by `factor`;
    shorter than original_max_position/high_freq_factor are kept; in between, a linear blend in
    original_max_position/wavelength.
    """
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = rope.original_max_position / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position / rope.high_freq_factor
    blend = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - blend) * inv_freq / rope.factor + blend * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)
