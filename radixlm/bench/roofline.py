"""The rooflines: a prefill's FLOPs against this host's matmul rate, and a decode step's bytes
against its read bandwidth.

A prefill is compute-bound: every token goes through every projection, so its speed is judged
against the host's matmul rate, not against memory bandwidth (decode's roofline, see
model_speed). `prefill_flops` counts the useful work of one prefill the same way for every
engine (transformers does the same matmuls, the same causal attention and, with
`logits_to_keep=1`, the same one logits row); `matmul_peak_timer` times a large `F.linear` in
the caller's process, so it runs at the same threads, dtype and instruction-set caps
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) as the engines beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixlm.model.arch import ArchConfig

PEAK_SIZE = 2048  # the peak's F.linear: (PEAK_SIZE x PEAK_SIZE) @ (PEAK_SIZE x PEAK_SIZE)^T
PEAK_FLOPS = 2 * PEAK_SIZE**3


class PrefillFlops(NamedTuple):
    """FLOPs of one prefill of n tokens from an empty cache; a multiply-add counts 2."""

    matmuls: int  # the layers' projections: 2 n per weight element
    attention: int  # causal QK^T and PV: 2 D per (query, key) pair, n (n + 1) / 2 pairs a head
    logits: int  # the last token's row of the LM head

    @property
    def total(self) -> int:
        return self.matmuls + self.attention + self.logits


def prefill_flops(config: ArchConfig, num_tokens: int) -> PrefillFlops:
    """The FLOPs a prefill of `num_tokens` must do (norms, rope and softmax left out: a few per
    element, under 1 % here)."""
    c, n = config, num_tokens
    weights = (
        c.hidden_size * (c.q_size + 2 * c.kv_size)  # q, k, v projections
        + c.q_size * c.hidden_size  # o projection
        + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    )  # per layer
    pairs = n * (n + 1) // 2  # causal (query, key) pairs per head
    return PrefillFlops(
        matmuls=2 * n * weights * c.num_layers,
        attention=2 * 2 * c.head_dim * pairs * c.num_heads * c.num_layers,
        logits=2 * c.hidden_size * c.vocab_size,
    )


def matmul_peak_timer(dtype: torch.dtype) -> Callable[[], float]:
    """A timer (one call: seconds) of one PEAK_FLOPS `F.linear` in `dtype` on the CPU: this
    host's matmul rate at the process's threads and caps, what a prefill can at best reach."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=generator).to(dtype)
    w = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=generator).to(dtype)

    def timer() -> float:
        start = time.perf_counter()
        F.linear(x, w)
        return time.perf_counter() - start

    return timer


READ_BYTES = 1 << 29  # the bandwidth probe's buffer: far larger than any cache


def read_bandwidth_timer() -> tuple[Callable[[], float], int]:
    """(timer, bytes): one call sums a READ_BYTES float32 buffer (a vectorized reduction) with
    the process's threads and returns seconds: this host's read bandwidth, what a memory-bound
    decode step can at best stream its weights at (decode's roofline)."""
    buffer = torch.ones(READ_BYTES // 4, dtype=torch.float32)

    def timer() -> float:
        start = time.perf_counter()
        buffer.sum()
        return time.perf_counter() - start

    return timer, READ_BYTES
