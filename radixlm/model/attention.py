"""Attention over KV pool slots: what each new token attends to, for extend and decode steps.

`AttentionPlan.build(batch, ...)` turns a ForwardBatch into the index tensors, masks and gather
buffers that every layer reuses (built once per forward, never per layer). `attend(...)` then
runs one layer. On CPU, with a float32, bfloat16 or int8 pool, the native kernels (native.py,
csrc/) do all of it, reading K/V where it lies in the pool:

  extend  one call for every multi-token request: query i of e new tokens sees keys
          0 .. prefix_len + i (flash attention in register tiles, csrc/extend_attention.c).
  decode  one call for every one-token request on a prefix (a whole decode step, or the decodes
          that ride along with a prefill chunk); requests on a shared run of slots read it once
          (csrc/decode_attention.c).

Elsewhere (no C compiler, RADIXLM_NATIVE=0, a GPU), PyTorch's SDPA over gathered K/V:

  extend  one SDPA call per multi-token request. Its queries are its new tokens; its keys are
          the K/V of all its seq_slots gathered from the pool (prefix + new). With a prefix,
          a causal mask shifted right by the prefix; without one, plain `is_causal` on the
          fresh K/V, no gather.
  decode  one SDPA call for the one-token requests. Slots are gathered into a padded
          (B, L_max) layout; a length mask hides the padding. GQA needs no repeated K/V: the
          query heads sharing a KV head are folded into the query-length axis,
          (B, kv_heads, group, D). When several requests share a long run of prefix slots,
          the run is read once for all of them (shared_prefix.py).

Gathers (kv_gather.py) write into two buffers allocated here once per forward (float32 for an
int8 pool: gathers dequantize, exactly). The caller has already written the new tokens' K/V
into `batch.out_slots` of this layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixlm.cache.kv_pool import LayerKV
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.kv_gather import PaddedRuns, gather_rows, head_rows
from radixlm.model.native import DecodeLayout, ExtendLayout, Kernels
from radixlm.model.shared_prefix import SharedDecode, plan_shared_decode, shared_decode_attention
from radixlm.model.verify_rows import decode_units


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
    """The batch's decodes (ForwardBatch.is_decode), attended together: by the native kernel
    (`layout`), or else one padded SDPA call (`plain`), or the shared-prefix split when several
    of them share a long run of slots (`shared`)."""

    token_rows: torch.Tensor  # (B,) their rows among the T new tokens
    layout: DecodeLayout | None  # the group as the native decode kernel takes it
    plain: PaddedRuns | None  # every member's whole slot list, for PyTorch attention
    shared: SharedDecode | None  # the split, when it reads clearly fewer K/V rows

    @property
    def max_rows(self) -> int:
        rows = 0 if self.plain is None else self.plain.gather_rows.numel()
        return rows if self.shared is None else max(rows, self.shared.max_rows)


@dataclass(frozen=True)
class AttentionPlan:
    """Per-forward attention layout, shared by all layers: a span per multi-token request, and
    one DecodeGroup for the decodes. In a pure decode step (`pure_decode`) the group holds every
    row, in order."""

    kernels: Kernels | None  # the native kernels, when this forward uses them
    pure_decode: bool  # ForwardBatch.is_pure_decode
    spans: list[ExtendSpan]  # multi-token requests for PyTorch attention
    native_spans: ExtendLayout | None  # or all of them, for the native extend kernel
    decode: DecodeGroup | None
    k_buffer: torch.Tensor  # (rows, D) gather destination, reused by every layer
    v_buffer: torch.Tensor

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: torch.dtype,
        kernels: Kernels | None = None,
        *,
        num_heads: int,
    ) -> AttentionPlan:
        """`kernels`: the native kernels, for K/V in a CPU pool they read (or None); kv_dtype:
        the pool's; `num_heads`: query heads (the decode kernel's units are sized in query rows)."""
        device = batch.input_ids.device
        spans: list[ExtendSpan] = []
        for_kernel: list[tuple[int, int, int, torch.Tensor]] = []  # (start, e, prefix, slots)
        decodes: list[int] = []
        start = 0
        for i, (slots, prefix_len, extend_len) in enumerate(
            zip(batch.seq_slots, batch.prefix_lens, batch.extend_lens)
        ):
            if batch.is_decode[i]:
                decodes.append(i)
            elif kernels is not None:
                for_kernel.append((start, extend_len, prefix_len, slots))
            else:
                spans.append(_extend_span(slots, prefix_len, extend_len, start, num_kv_heads))
            start += extend_len
        native_spans = ExtendLayout(for_kernel) if for_kernel else None
        native = kernels is not None
        group = num_heads // num_kv_heads
        decode = _decode_group(batch, decodes, num_kv_heads, group, native) if decodes else None
        num_rows = max(
            [0]
            + [s.gather_rows.numel() for s in spans if s.gather_rows is not None]
            + ([decode.max_rows] if decode else [])
        )
        buffer_dtype = torch.float32 if kv_dtype == torch.int8 else kv_dtype  # dequantized
        k_buffer = torch.empty(num_rows, head_dim, dtype=buffer_dtype, device=device)
        v_buffer = torch.empty_like(k_buffer)
        pure = batch.is_pure_decode
        return cls(kernels, pure, spans, native_spans, decode, k_buffer, v_buffer)


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


def _decode_group(
    batch: ForwardBatch, members: list[int], num_kv_heads: int, query_group: int, native: bool
) -> DecodeGroup:
    device = batch.input_ids.device
    slot_lists = [batch.seq_slots[i] for i in members]
    ends = np.cumsum(batch.extend_lens)
    token_rows = torch.from_numpy(ends[members] - 1).to(device)  # each member's one new token
    if native:
        # verify chains keep a lone decode's bits (verify_rows.py); other rows share runs
        layout = DecodeLayout(slot_lists, decode_units(batch, members, query_group))
        return DecodeGroup(token_rows, layout, None, None)
    shared = plan_shared_decode(slot_lists, num_kv_heads) if device.type == "cpu" else None
    return DecodeGroup(token_rows, None, PaddedRuns.of(slot_lists, num_kv_heads), shared)


def attend_native(q: torch.Tensor, kv: LayerKV, plan: AttentionPlan) -> torch.Tensor:
    """Attention output (T, heads * head_dim) for q (T, heads, D) by the native kernels, which
    read K/V in the pool only: kv, this layer's pool views (num_slots, kv_heads, D) and an int8
    pool's scales, already holds the new tokens' K/V. The plan was built with the kernels."""
    kernels, group = plan.kernels, plan.decode
    assert kernels is not None  # NativeBackend.plan builds it with them
    if plan.pure_decode and group is not None:  # the group's rows are all the rows, in order
        return _decode_native(kernels, q, kv, group)
    num_tokens = q.shape[0]
    if plan.native_spans is not None:  # every multi-token request at once
        out = kernels.extend(q, kv.k, kv.v, plan.native_spans, kv.scales).view(num_tokens, -1)
    else:
        out = q.new_empty(num_tokens, q.shape[1] * q.shape[2])
    if group is not None:  # the decodes riding along
        out[group.token_rows] = _decode_native(kernels, q[group.token_rows], kv, group)
    return out


def attend_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, plan: AttentionPlan
) -> torch.Tensor:
    """Attention output (T, heads * head_dim) for q (T, heads, D) and the fresh k, v (T, kv, D)
    (as the pool holds them) by PyTorch's SDPA; kv as in attend_native."""
    group = plan.decode
    if plan.pure_decode and group is not None:
        return _decode_torch(q, kv, plan, group)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for span in plan.spans:
        out[span.start : span.end] = _extend_one(q, k, v, kv, plan, span)
    if group is not None:
        out[group.token_rows] = _decode_torch(q[group.token_rows], kv, plan, group)
    return out


def _extend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
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
        k_scales, v_scales = (None, None) if kv.scales is None else kv.scales
        ks = gather_rows(kv.k, span.gather_rows, plan.k_buffer, k_scales).view(shape).to(q.dtype)
        vs = gather_rows(kv.v, span.gather_rows, plan.v_buffer, v_scales).view(shape).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(qs.shape[2], -1)  # (e, heads * D)


def _decode_native(
    kernels: Kernels, q: torch.Tensor, kv: LayerKV, group: DecodeGroup
) -> torch.Tensor:
    """q (B, heads, D): one query per request of the group -> (B, heads * D)."""
    assert group.layout is not None  # built with the kernels
    batch_size, num_heads, head_dim = q.shape
    o = kernels.decode(q, kv.k, kv.v, group.layout, kv.scales)  # (B, heads, D)
    return o.view(batch_size, num_heads * head_dim)


def _decode_torch(
    q: torch.Tensor, kv: LayerKV, plan: AttentionPlan, group: DecodeGroup
) -> torch.Tensor:
    """q (B, heads, D): one query per request of the group -> (B, heads * D)."""
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    qs = q.reshape(batch_size, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B,kv,G,D)
    if group.shared is not None:
        buffers = (plan.k_buffer, plan.v_buffer)
        o = shared_decode_attention(qs, kv, group.shared, buffers)
    else:
        runs = group.plain
        assert runs is not None  # built whenever the kernel is not
        ks, vs = runs.gather_kv(kv, (plan.k_buffer, plan.v_buffer), q.dtype)  # (B, kv, L, D)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=runs.key_mask)  # (B,kv,G,D)
    return o.reshape(batch_size, num_heads * head_dim)
