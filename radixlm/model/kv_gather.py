"""Gathering K/V out of the pool: runs of slots into a padded (N, kv_heads, L, D) layout.

The pool is read as rows of one head, (num_slots * kv_heads, D) (or, head-major, (kv_heads *
num_slots, D)), so gathered K/V come out contiguous in SDPA's (batch, kv_heads, len, D) order.
Gathers write into buffers allocated once per forward and reused by every layer (a fresh 24 MB
tensor per layer costs more in page faults than the copy itself). An int8 pool's rows come out
dequantized (codes times their row's scale, exact in float32) into float32 buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.cache.kv_pool import LayerKV


@dataclass(frozen=True)
class PaddedRuns:
    """N runs of slots (each a request's sequence or part of it), padded to the longest."""

    gather_rows: torch.Tensor  # (N * kv_heads * L,) head rows; padding points at row 0
    length: int  # L, the longest run
    key_mask: torch.Tensor | None  # (N, 1, 1, L) bool, True = a real key; None = no padding
    num_runs: int

    @classmethod
    def of(cls, runs: list[torch.Tensor], num_kv_heads: int) -> PaddedRuns:
        lengths = [len(r) for r in runs]
        longest = max(lengths)
        padded = torch.nn.utils.rnn.pad_sequence(runs, batch_first=True)  # (N, L)
        key_mask = None
        if min(lengths) != longest:
            device = padded.device
            lens = torch.tensor(lengths, device=device)
            keep = torch.arange(longest, device=device)[None, :] < lens[:, None]  # (N, L)
            key_mask = keep[:, None, None, :]  # (N, 1, 1, L)
        return cls(head_rows(padded, num_kv_heads), longest, key_mask, len(runs))

    def gather(
        self,
        cache: torch.Tensor,
        buffer: torch.Tensor,
        dtype: torch.dtype,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """cache (num_slots, kv, D) -> (N, kv, L, D), written into the front of `buffer`
        (int8 codes: dequantized by their `scales`, (num_slots, kv))."""
        out = gather_rows(cache, self.gather_rows, buffer, scales)
        return out.view(self.num_runs, cache.shape[1], self.length, cache.shape[2]).to(dtype)

    def gather_kv(
        self, kv: LayerKV, buffers: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool layer's K and V of the runs, each (N, kv, L, D), into the two buffers."""
        k_scales, v_scales = (None, None) if kv.scales is None else kv.scales
        return (
            self.gather(kv.k, buffers[0], dtype, k_scales),
            self.gather(kv.v, buffers[1], dtype, v_scales),
        )


def head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of the pool viewed as (num_slots * kv_heads, D) for slots (..., L), head-major.

    Row `slot * kv_heads + h` holds head h of a slot; the result is ordered (..., kv_heads, L).
    """
    heads = torch.arange(num_kv_heads, device=slots.device)[:, None]  # (kv, 1)
    return (slots.unsqueeze(-2) * num_kv_heads + heads).reshape(-1)  # (... * kv * L,)


def gather_rows(
    cache: torch.Tensor,
    rows: torch.Tensor,
    buffer: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """cache (num_slots, kv, D) -> its head rows `rows` (rows, D), in the front of `buffer`;
    int8 codes times their row's scale from `scales` (num_slots, kv), laid out as cache is.

    A head-major pool's view (KVPool) is read through its (kv * num_slots, D) rows: head row
    slot * kv + h is row h * num_slots + slot there."""
    out = buffer[: rows.numel()]
    num_slots, num_kv_heads, head_dim = cache.shape
    if cache.is_contiguous():
        flat = cache.view(-1, head_dim)
        flat_scales = None if scales is None else scales.reshape(-1)
    else:
        flat = cache.transpose(0, 1).view(-1, head_dim)  # raises unless head-major
        flat_scales = None if scales is None else scales.transpose(0, 1).reshape(-1)
        rows = rows % num_kv_heads * num_slots + rows // num_kv_heads
    if flat_scales is None:
        torch.index_select(flat, 0, rows, out=out)
        return out
    row_scales = flat_scales.index_select(0, rows).float()[:, None]  # (rows, 1)
    torch.mul(flat.index_select(0, rows), row_scales, out=out)  # int8 * float32 -> float32
    return out
