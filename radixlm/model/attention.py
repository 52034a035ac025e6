"""Attention over KV pool slots: what each new token attends to, for extend and decode steps.

`AttentionPlan.build(batch, ...)` turns a ForwardBatch into the index tensors, masks and gather
buffers that every layer reuses (built once per forward, never per layer). `attend(...)` then
runs one layer:

  extend  one SDPA call per multi-token request. Its queries are its new tokens; its keys are
          the K/V of all its seq_slots gathered from the pool (prefix + new). With a prefix,
          query i of e new tokens sees keys 0 .. prefix_len + i (a causal mask shifted right
          by the prefix); without one, plain `is_causal` on the fresh K/V, no gather.
  decode  one SDPA call for every one-token request on a prefix: a whole decode step, or the
          decodes that ride along with a prefill chunk in a mixed step. Slots are gathered into
          a padded (B, L_max) layout; a length mask hides the padding. GQA needs no repeated
          K/V: the query heads sharing a KV head are folded into the query-length axis,
          (B, kv_heads, group, D).

Gathers read the pool as rows of one head, (num_slots * kv_heads, D), so the gathered K/V come
out contiguous in SDPA's (batch, kv_heads, len, D) order, into buffers reused by every layer
(a fresh 24 MB tensor per layer costs more in page faults than the copy itself).
The caller has already written the new tokens' K/V into `batch.out_slots` of this layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.shared_prefix import (
    SharedPrefix,
    attention_with_lse,
    find_shared_prefixes,
    merge,
    suffix_slots,
)


@dataclass(frozen=True)
class ExtendSpan:
    """One request of an extend step: rows [start, end) of the new tokens, and what they see."""

    start: int
    end: int
    seq_len: int  # prefix_len + extend_len
    gather_rows: torch.Tensor | None  # (kv_heads * seq_len,) head rows; None without prefix
    mask: torch.Tensor | None  # (extend_len, seq_len) bool; None = fresh causal


@dataclass(frozen=True)
class DecodeGroup:
    """Requests with one new token on top of a prefix, attended in one padded call; runs of
    slots that several of them share are attended once for all (see shared_prefix.py), and
    `gather_rows` then covers each request's own slots after its shared run."""

    token_rows: torch.Tensor | None  # (B,) their rows among the T new tokens; None = all, in order
    gather_rows: torch.Tensor  # (B * kv_heads * L_max,) head rows; pads -> row 0
    max_seq_len: int  # L_max
    length_mask: torch.Tensor | None  # (B, 1, 1, L_max) bool; None if no padding
    shared: list[SharedPrefix]


@dataclass(frozen=True)
class AttentionPlan:
    """Per-forward attention layout, shared by all layers. A decode step is one DecodeGroup; an
    extend step has a span per multi-token request, and its one-token requests (decodes riding
    along with a prefill chunk) form a DecodeGroup of their own."""

    spans: list[ExtendSpan]
    decode: DecodeGroup | None
    k_buffer: torch.Tensor  # (rows, D) gather destination, reused by every layer
    v_buffer: torch.Tensor

    @classmethod
    def build(
        cls, batch: ForwardBatch, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype
    ) -> AttentionPlan:
        device = batch.input_ids.device
        spans: list[ExtendSpan] = []
        one_token: list[int] = []  # requests that go to the decode group
        start = 0
        for i, (slots, prefix_len, extend_len) in enumerate(
            zip(batch.seq_slots, batch.prefix_lens, batch.extend_lens)
        ):
            if extend_len == 1 and prefix_len > 0:
                one_token.append(i)
            else:
                spans.append(_extend_span(slots, prefix_len, extend_len, start, num_kv_heads))
            start += extend_len
        decode = None
        if one_token:
            decode = _decode_group(batch, one_token, num_kv_heads)
        num_rows = max(
            [0]
            + [s.gather_rows.numel() for s in spans if s.gather_rows is not None]
            + ([decode.gather_rows.numel()] if decode else [])
            + ([sp.gather_rows.numel() for sp in decode.shared] if decode else [])
        )
        k_buffer = torch.empty(num_rows, head_dim, dtype=kv_dtype, device=device)
        v_buffer = torch.empty_like(k_buffer)
        return cls(spans, decode, k_buffer, v_buffer)


def _extend_span(
    slots: torch.Tensor, prefix_len: int, extend_len: int, start: int, num_kv_heads: int
) -> ExtendSpan:
    seq_len = prefix_len + extend_len
    rows, mask = None, None
    if prefix_len > 0:
        rows = head_rows(slots, num_kv_heads)  # (kv * seq_len,)
        query_pos = torch.arange(extend_len, device=slots.device)[:, None] + prefix_len
        mask = torch.arange(seq_len, device=slots.device)[None, :] <= query_pos
    return ExtendSpan(start, start + extend_len, seq_len, rows, mask)


def _decode_group(batch: ForwardBatch, members: list[int], num_kv_heads: int) -> DecodeGroup:
    device = batch.input_ids.device
    slot_lists = [batch.seq_slots[i] for i in members]
    groups = find_shared_prefixes(slot_lists) if device.type == "cpu" else []
    shared = [
        SharedPrefix(
            torch.tensor(group, device=device),
            length,
            head_rows(slot_lists[group[0]][:length], num_kv_heads),
        )
        for group, length in groups
    ]
    own = suffix_slots(slot_lists, groups)
    seq_lens = [len(s) for s in own]
    max_len = max(seq_lens)
    padded = torch.nn.utils.rnn.pad_sequence(own, batch_first=True)
    length_mask = None
    if min(seq_lens) != max_len:
        lens = torch.tensor(seq_lens, device=device)
        keep = torch.arange(max_len, device=device)[None, :] < lens[:, None]  # (B, L)
        length_mask = keep[:, None, None, :]  # (B, 1, 1, L_max)
    token_rows = None
    if len(members) != batch.batch_size:  # a mixed batch: pick the members' rows out of T
        ends = torch.tensor(batch.extend_lens, device=device).cumsum(0)
        token_rows = ends[members] - 1
    rows = head_rows(padded, num_kv_heads)
    return DecodeGroup(token_rows, rows, max_len, length_mask, shared)


def head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of the pool viewed as (num_slots * kv_heads, D) for slots (..., L), head-major.

    Row `slot * kv_heads + h` holds head h of a slot; the result is ordered (..., kv_heads, L).
    """
    heads = torch.arange(num_kv_heads, device=slots.device)[:, None]  # (kv, 1)
    return (slots.unsqueeze(-2) * num_kv_heads + heads).reshape(-1)  # (... * kv * L,)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Attention output (T, heads * head_dim) for q (T, heads, D) and the fresh k, v (T, kv, D).

    k_cache / v_cache: this layer's pool views (num_slots, kv_heads, D), already holding k, v.
    """
    group = plan.decode
    if group is not None and group.token_rows is None:  # a pure decode step
        return _decode(q, k_cache, v_cache, plan, group)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for span in plan.spans:
        out[span.start : span.end] = _extend_one(q, k, v, k_cache, v_cache, plan, span)
    if group is not None:
        out[group.token_rows] = _decode(q[group.token_rows], k_cache, v_cache, plan, group)
    return out


def _extend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    span: ExtendSpan,
) -> torch.Tensor:
    # 4-D inputs: CPU SDPA takes its flash kernel only for (batch, heads, len, D); 3-D falls
    # back to the unfused math path (4x slower at 1K tokens).
    qs = q[None, span.start : span.end].transpose(1, 2)  # (1, heads, e, D)
    if span.gather_rows is None:
        ks = k[None, span.start : span.end].transpose(1, 2)  # (1, kv_heads, e, D)
        vs = v[None, span.start : span.end].transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    else:
        shape = (1, k.shape[1], span.seq_len, k.shape[2])
        ks = _gather(k_cache, span.gather_rows, plan.k_buffer).view(shape).to(q.dtype)
        vs = _gather(v_cache, span.gather_rows, plan.v_buffer).view(shape).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(qs.shape[2], -1)  # (e, heads * D)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    group: DecodeGroup,
) -> torch.Tensor:
    """q (B, heads, D): one query per request of the group -> (B, heads * D)."""
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    shape = (batch_size, num_kv_heads, group.max_seq_len, head_dim)
    ks = _gather(k_cache, group.gather_rows, plan.k_buffer).view(shape).to(q.dtype)  # (B,kv,L,D)
    vs = _gather(v_cache, group.gather_rows, plan.v_buffer).view(shape).to(q.dtype)
    qs = q.reshape(batch_size, num_kv_heads, group_size, head_dim)  # (B, kv, G, D)
    if not group.shared:
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=group.length_mask)  # (B,kv,G,D)
        return o.reshape(batch_size, num_heads * head_dim)
    o, lse = attention_with_lse(qs, ks, vs, group.length_mask)  # own slots: (B,kv,G,D), (B,kv,G)
    for run in group.shared:  # the buffers are free again: the own part is computed
        n = run.members.numel()
        run_shape = (1, num_kv_heads, run.length, head_dim)
        kp = _gather(k_cache, run.gather_rows, plan.k_buffer).view(run_shape).to(q.dtype)
        vp = _gather(v_cache, run.gather_rows, plan.v_buffer).view(run_shape).to(q.dtype)
        qg = qs[run.members].transpose(0, 1).reshape(1, num_kv_heads, n * group_size, head_dim)
        op, lp = attention_with_lse(qg, kp, vp, None)  # (1, kv, n*G, D), (1, kv, n*G)
        op = op.view(num_kv_heads, n, group_size, head_dim).transpose(0, 1)  # (n, kv, G, D)
        lp = lp.view(num_kv_heads, n, group_size).transpose(0, 1)  # (n, kv, G)
        o[run.members] = merge(op, lp, o[run.members], lse[run.members])
    return o.reshape(batch_size, num_heads * head_dim)


def _gather(cache: torch.Tensor, rows: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """cache (num_slots, kv, D) -> its head rows `rows`, written into the front of `buffer`."""
    out = buffer[: rows.numel()]
    torch.index_select(cache.view(-1, cache.shape[-1]), 0, rows, out=out)
    return out
