"""Shared-prefix decode attention: the K/V of a prefix that several requests share is read once.

Requests that reuse a cached prefix point at the *same* pool slots for it (the radix tree hands
out its slots, never copies). In a decode step, plain batched attention still gathers and reads
that prefix once per request; with 8 requests on a 1K-token system prompt that is 8x the memory
traffic, and decode on a CPU is memory-bound. Here a decode step is split in two:

    shared part   queries of all n requests of a group (stacked)  x  the group's shared prefix
    own part      each request's query                            x  its slots after the prefix

Each part yields an output and the log-sum-exp of its scores; softmax over the union of keys is
the LSE-weighted mix of the two (the identity cascade / FlashInfer-style attention relies on):

    w_x = e^(lse_x - max(lse_shared, lse_own))
    out = (o_shared * w_shared + o_own * w_own) / (w_shared + w_own)

Groups are found from the slot ids alone (identical leading slots == identical KV), once per
forward; requests in no group take the own part over their whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A run shorter than this is not worth a second attention call.
MIN_SHARED_LEN = 32


@dataclass(frozen=True)
class SharedPrefix:
    """Decode requests whose slot lists begin with the same `length` slots."""

    members: torch.Tensor  # (n,) indices into the decode group
    length: int  # tokens of the shared run
    gather_rows: torch.Tensor  # (kv_heads * length,) head rows of the run (see head_rows)


def find_shared_prefixes(slot_lists: list[torch.Tensor]) -> list[tuple[list[int], int]]:
    """Groups of >= 2 requests with a common leading run of >= MIN_SHARED_LEN slots, as
    (member indices, run length). The run stops at least one slot short of every member's end,
    so each member keeps an own part (its newest token, at least)."""
    by_first: dict[int, list[int]] = {}
    for i, slots in enumerate(slot_lists):
        if len(slots) > MIN_SHARED_LEN:
            by_first.setdefault(int(slots[0]), []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        arrays = [slot_lists[i].numpy() for i in members]
        base = arrays[0]
        length = min(len(a) for a in arrays) - 1
        for other in arrays[1:]:
            differs = base[:length] != other[:length]
            if differs.any():
                length = int(differs.argmax())
        if length >= MIN_SHARED_LEN:
            groups.append((members, length))
    return groups


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of each query's scores.

    q (..., Lq, D), k / v (..., Lk, D), mask broadcastable to (..., Lq, Lk) (True = attend).
    Returns out (..., Lq, D) and lse (..., Lq). Decode-sized queries only: scores are formed.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (..., Lq, Lk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (..., Lq)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A ∪ B from attention over A and over B (outputs and LSEs)."""
    top = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - top).unsqueeze(-1)
    w_b = torch.exp(lse_b - top).unsqueeze(-1)
    return (out_a * w_a + out_b * w_b) / (w_a + w_b)


def suffix_slots(
    slot_lists: list[torch.Tensor], groups: list[tuple[list[int], int]]
) -> list[torch.Tensor]:
    """Each request's slots after its group's shared run (all of them outside any group)."""
    skip = np.zeros(len(slot_lists), dtype=np.int64)
    for members, length in groups:
        skip[members] = length
    return [slots[int(n) :] for slots, n in zip(slot_lists, skip)]
