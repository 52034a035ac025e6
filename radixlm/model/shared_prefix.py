"""Shared-prefix decode attention: the K/V of a prefix that several requests share is read once.

Requests that reuse a cached prefix point at the *same* pool slots for it (the radix tree hands
out its slots, never copies). Plain batched decode attention still gathers and reads that prefix
once per request; with 8 requests on a 1K-token system prompt that is 8x the memory traffic, and
decode on a CPU is memory-bound. Here a decode step is split in two:

    shared part   each group's queries (stacked)  x  the group's shared run of slots
    own part      each request's query            x  its slots after the run

Each part yields an output and the log-sum-exp (LSE) of its scores; softmax over the union of
keys is the LSE-weighted mix of the two (the identity cascade / FlashInfer-style attention uses):

    w_x = e^(lse_x - max(lse_shared, lse_own))
    out = (o_shared * w_shared + o_own * w_own) / (w_shared + w_own)

Groups are found from the slot ids alone (identical leading slots == identical KV), once per
forward. All groups run in one padded call and requests in no group in a plain call of their
own, so the number of ops per layer does not grow with the number of groups. The split is taken
only when it reads clearly fewer K/V rows than plain padded attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixlm.cache.kv_pool import LayerKV
from radixlm.model.kv_gather import PaddedRuns

# A run shorter than this is not worth a second attention call.
MIN_SHARED_LEN = 32
# Split only when it reads at most this fraction of the K/V rows plain attention reads.
MAX_READ_FRACTION = 0.75


@dataclass(frozen=True)
class SharedDecode:
    """The split of one decode batch (B requests) into grouped and other requests."""

    grouped: torch.Tensor  # (M,) batch indices of grouped requests, group after group
    others: torch.Tensor | None  # (B - M,) the rest; None if every request is in a group
    own_grouped: PaddedRuns  # grouped requests' slots after their group's run
    own_others: PaddedRuns | None  # the others' whole slot lists
    runs: PaddedRuns  # one per group: its shared run
    query_index: torch.Tensor  # (num_groups, n_max) positions in `grouped`, padded with 0
    valid: torch.Tensor  # (M,) positions in num_groups * n_max of the real members

    @property
    def max_rows(self) -> int:
        parts = [self.own_grouped, self.runs] + ([self.own_others] if self.own_others else [])
        return max(p.gather_rows.numel() for p in parts)


def plan_shared_decode(slot_lists: list[torch.Tensor], num_kv_heads: int) -> SharedDecode | None:
    """The split for these requests' slot lists, or None when sharing would not pay."""
    groups = find_shared_prefixes(slot_lists)
    if not groups:
        return None
    device = slot_lists[0].device
    run_of = np.zeros(len(slot_lists), dtype=np.int64)  # shared-run length per request
    for members, length in groups:
        run_of[members] = length
    grouped = [i for members, _ in groups for i in members]
    others = [i for i in range(len(slot_lists)) if run_of[i] == 0]
    own = [slot_lists[i][int(run_of[i]) :] for i in grouped]
    plain_rows = len(slot_lists) * max(len(s) for s in slot_lists)
    split_rows = len(own) * max(len(s) for s in own) + len(groups) * max(n for _, n in groups)
    if others:
        split_rows += len(others) * max(len(slot_lists[i]) for i in others)
    if split_rows > MAX_READ_FRACTION * plain_rows:
        return None
    n_max = max(len(members) for members, _ in groups)
    query_index = torch.zeros(len(groups), n_max, dtype=torch.int64)
    valid: list[int] = []
    start = 0
    for g, (members, _) in enumerate(groups):
        query_index[g, : len(members)] = torch.arange(start, start + len(members))
        valid.extend(range(g * n_max, g * n_max + len(members)))
        start += len(members)
    runs = [slot_lists[members[0]][:length] for members, length in groups]
    return SharedDecode(
        grouped=torch.tensor(grouped, device=device),
        others=torch.tensor(others, device=device) if others else None,
        own_grouped=PaddedRuns.of(own, num_kv_heads),
        own_others=PaddedRuns.of([slot_lists[i] for i in others], num_kv_heads) if others else None,
        runs=PaddedRuns.of(runs, num_kv_heads),
        query_index=query_index.to(device),
        valid=torch.tensor(valid, device=device),
    )


def shared_decode_attention(
    qs: torch.Tensor,
    layer: LayerKV,
    split: SharedDecode,
    buffers: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """qs (B, kv, G, D): one query per request, its G heads per KV head -> (B, kv, G, D); layer:
    this layer of the pool."""
    out = torch.empty_like(qs)
    if split.others is not None and split.own_others is not None:  # no LSE needed: plain SDPA
        runs = split.own_others
        ks, vs = runs.gather_kv(layer, buffers, qs.dtype)
        out[split.others] = F.scaled_dot_product_attention(
            qs[split.others], ks, vs, attn_mask=runs.key_mask
        )
    q_grouped = qs[split.grouped]  # (M, kv, G, D)
    runs = split.own_grouped
    ks, vs = runs.gather_kv(layer, buffers, qs.dtype)
    o_own, lse_own = attention_with_lse(q_grouped, ks, vs, runs.key_mask)  # (M,kv,G,D), (M,kv,G)
    num_groups, n_max = split.query_index.shape
    _, kv, g, d = q_grouped.shape
    q_stack = q_grouped[split.query_index]  # (groups, n_max, kv, G, D)
    q_stack = q_stack.permute(0, 2, 1, 3, 4).reshape(num_groups, kv, n_max * g, d)
    runs = split.runs
    ks, vs = runs.gather_kv(layer, buffers, qs.dtype)
    o_run, lse_run = attention_with_lse(q_stack, ks, vs, runs.key_mask)  # (groups,kv,n_max*G,.)
    o_run = o_run.view(num_groups, kv, n_max, g, d).permute(0, 2, 1, 3, 4).reshape(-1, kv, g, d)
    lse_run = lse_run.view(num_groups, kv, n_max, g).permute(0, 2, 1, 3).reshape(-1, kv, g)
    valid = split.valid
    out[split.grouped] = merge(o_run[valid], lse_run[valid], o_own, lse_own).to(out.dtype)
    return out


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
        arrays = [slot_lists[i].cpu().numpy() for i in members]
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of each query's scores.

    q (N, H, Lq, D), k / v (N, H, Lk, D), key_mask (N, 1, 1, Lk) bool or None (True = attend).
    Returns out (N, H, Lq, D) and lse (N, H, Lq). Uses PyTorch's fused CPU flash kernel, which
    returns the LSE, where it exists; otherwise forms the scores (decode-sized queries only).
    """
    if q.device.type == "cpu" and _FLASH_WITH_LSE is not None:
        additive = None
        if key_mask is not None:  # the kernel takes an additive mask of the query's dtype
            additive = torch.zeros(key_mask.shape, dtype=q.dtype).masked_fill_(
                ~key_mask, float("-inf")
            )
        out, lse = _FLASH_WITH_LSE(q, k, v, 0.0, False, attn_mask=additive)
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (N, H, Lq, Lk)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (N, H, Lq)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A ∪ B from attention over A and over B (outputs and LSEs)."""
    top = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - top).unsqueeze(-1)
    w_b = torch.exp(lse_b - top).unsqueeze(-1)
    return (out_a * w_a + out_b * w_b) / (w_a + w_b)


# PyTorch's CPU flash-attention kernel returns (out, logsumexp); it is a private op, so fall back
# to the explicit formula if a torch build lacks it.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
