"""Gathering K/V out of the pool: runs of slots into a padded (N, kv_heads, L, D) layout.

The pool is read as rows of one head, (num_slots * kv_heads, D) (or, head-major, (kv_heads *
num_slots, D)), so gathered K/V come out contiguous in SDPA's (batch, kv_heads, len, D) order.
Gathers write into buffers allocated once per forward and reused by every layer (a fresh 24 MB
tensor per layer costs more in page faults than the copy itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def gather(self, cache: torch.Tensor, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cache (num_slots, kv, D) -> (N, kv, L, D), written into the front of `buffer`."""
        out = gather_rows(cache, self.gather_rows, buffer)
        return out.view(self.num_runs, cache.shape[1], self.length, cache.shape[2]).to(dtype)


def head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of the pool viewed as (num_slots * kv_heads, D) for slots (..., L), head-major.

    Row `slot * kv_heads + h` holds head h of a slot; the result is ordered (..., kv_heads, L).
    """
    heads = torch.arange(num_kv_heads, device=slots.device)[:, None]  # (kv, 1)
    return (slots.unsqueeze(-2) * num_kv_heads + heads).reshape(-1)  # (... * kv * L,)


def gather_rows(cache: torch.Tensor, rows: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """cache (num_slots, kv, D) -> its head rows `rows` (rows, D), in the front of `buffer`.

    A head-major pool's view (KVPool) is read through its (kv * num_slots, D) rows: head row
    slot * kv + h is row h * num_slots + slot there."""
    out = buffer[: rows.numel()]
    num_slots, num_kv_heads, head_dim = cache.shape
    if cache.is_contiguous():
        torch.index_select(cache.view(-1, head_dim), 0, rows, out=out)
    else:
        by_head = cache.transpose(0, 1).view(-1, head_dim)  # raises unless head-major
        rows = rows % num_kv_heads * num_slots + rows // num_kv_heads
        torch.index_select(by_head, 0, rows, out=out)
    return out
