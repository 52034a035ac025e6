"""The Llama-family decoder: one module tree for Llama, SmolLM2, Mistral, Qwen2 and Qwen3.

Parameter names are the Hugging Face ones (`model.layers.3.self_attn.o_proj.weight`), with two
exceptions made for speed: q/k/v projections are stacked into one `qkv_proj` and gate/up into
one `gate_up_proj`, so a layer runs 4 matmuls instead of 7. The loader fills them by name
(see `FUSED_WEIGHTS`). Parameters are allocated uninitialized: a model is always loaded.

Data flow of `CausalLM.forward(batch, pool)`, T new tokens of all requests back to back:

  input_ids (T,) -> embed (T, hidden) -> [layer] x N -> final norm -> logits rows -> lm_head
  layer: (hidden, residual) -> (hidden, residual):
    residual += hidden; x = norm(residual)          one fused add + norm (RMSNorm.add_forward)
    residual += o_proj(attend(rope(q), rope(k) -> pool, v -> pool)); x = norm(residual)
    hidden = down(silu(gate(x)) * up(x))            added by the next layer's (or final) norm

The model holds no state between calls: K/V live in the pool, everything else in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixlm import hugepages
from radixlm.cache.kv_pool import KVPool
from radixlm.model import native, packed_linear
from radixlm.model.arch import ArchConfig
from radixlm.model.attention import AttentionPlan, attend
from radixlm.model.backend import PYTORCH, Backend, onednn_packs
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.rope import apply_rope, inverse_frequencies, rope_cos_sin

# Hugging Face projection name -> (our stacked parameter, index of its block in the stack)
FUSED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Linear(nn.Module):
    """y = x W^T (+ b), W (out, in), allocated uninitialized (the loader fills it).

    After `pack`, W is held in oneDNN's layout (where that pays, backend.onednn_packs), and
    (with the native kernels) also in the skinny kernel's, which matmuls of up to
    `native_rows` rows then go through (decode batches stream it faster than oneDNN or MKL
    multiply it). The other copy serves the PyTorch path and the rows the kernels leave to
    oneDNN or F.linear: a second copy of the weights, memory for speed."""

    skinny: torch.Tensor | None = None  # W for native.Kernels.skinny_linear
    # the model's backend's kernels and row limit (CausalLM.use_kernels; Backend.native_linear_rows)
    skinny_kernels: native.Kernels | None = None
    native_rows: int = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tied_weight: nn.Parameter | None = None,
    ):
        super().__init__()
        if tied_weight is None:
            tied_weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
        self.weight = tied_weight
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels, skinny = self.skinny_kernels, self.skinny
        if (
            kernels is not None
            and skinny is not None
            and x.dim() == 2
            and 0 < x.shape[0] <= self.native_rows
            and x.dtype == skinny.dtype
        ):
            y = kernels.skinny_linear(x.contiguous(), skinny)
            return y if self.bias is None else y + self.bias
        return packed_linear.linear(x, self.weight, self.bias)

    def pack(
        self,
        kernels: native.Kernels | None = None,
        arena: hugepages.Arena | None = None,
        onednn: bool = True,
    ) -> None:
        """Hold the weight in oneDNN's blocked layout (see packed_linear) if `onednn`; unties a
        tied one either way. With `kernels`, also keep it in the skinny kernel's layout (in
        `arena` if given), which forward uses once the model's backend has those kernels."""
        if kernels is not None:
            self.skinny = native.pack_skinny(self.weight, arena)
        dense = self.weight.detach().contiguous()
        self.weight = nn.Parameter(packed_linear.pack_weight(dense) if onednn else dense, False)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype), False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(
        self, h: torch.Tensor, delta: torch.Tensor | None, kernels: native.Kernels | None
    ) -> torch.Tensor:
        """h += delta in place (the residual stream; no add when delta is None), then the norm
        of h: one native call where the kernels are built, else PyTorch's ops."""
        if kernels is not None:
            return kernels.add_rms_norm(h, delta, self.weight, self.eps)
        if delta is not None:
            h += delta
        return self(h)


class Attention(nn.Module):
    def __init__(self, config: ArchConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.layer_id = layer_id  # which of the pool's layers holds this layer's K/V
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.split_sizes = [c.q_size, c.kv_size, c.kv_size]
        self.qkv_proj = Linear(c.hidden_size, c.q_size + 2 * c.kv_size, c.qkv_bias, dtype)
        self.o_proj = Linear(c.q_size, c.hidden_size, c.o_bias, dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x (T, hidden), normed -> the attention output (T, hidden); the K/V of every token
        of x go into this layer's pool slots first."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        k_cache, v_cache = ctx.pool.k_cache(self.layer_id), ctx.pool.v_cache(self.layer_id)
        kernels = ctx.backend.kernels
        if kernels is not None and self.q_norm is None:
            # rope on q and k, and the K/V write into the pool, in one native call (float32
            # cos/sin: see CausalLM.forward)
            q = kernels.rope_store(qkv, ctx.rope, ctx.out_slots, k_cache, v_cache, self.num_heads)
            return self.o_proj(attend(q, None, None, k_cache, v_cache, ctx.plan))
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, heads, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, kv_heads, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, kv_heads, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *ctx.rope), apply_rope(k, *ctx.rope)
        k_cache.index_copy_(0, ctx.out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.out_slots, v.to(v_cache.dtype))
        return self.o_proj(attend(q, k, v, k_cache, v_cache, ctx.plan))


class MLP(nn.Module):
    def __init__(self, config: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.split_sizes = [config.intermediate_size, config.intermediate_size]
        bias = config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor, kernels: native.Kernels | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels is not None and gate_up.is_contiguous():
            return self.down_proj(kernels.silu_mul(gate_up))  # one native call
        gate, up = gate_up.split(self.split_sizes, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (hidden, residual), each (T, hidden). The incoming hidden (the
        previous layer's MLP output) is added to the residual stream by the fused add + norm
        that opens this layer; the first layer gets the embeddings as hidden and no residual
        yet. The residual stream is updated in place."""
        kernels = ctx.backend.kernels
        if residual is None:
            residual = hidden
            x = self.input_layernorm.add_forward(residual, None, kernels)
        else:
            x = self.input_layernorm.add_forward(residual, hidden, kernels)
        x = self.post_attention_layernorm.add_forward(residual, self.self_attn(x, ctx), kernels)
        return self.mlp(x, kernels), residual


class Decoder(nn.Module):
    """The Hugging Face `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


@dataclass(frozen=True)
class ForwardContext:
    """What every layer of one forward reads besides its hidden states, built once per forward."""

    backend: Backend
    plan: AttentionPlan
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sign-folded sin, each (T, 1, head_dim)
    out_slots: torch.Tensor  # (T,) where the new tokens' K/V go
    pool: KVPool


class CausalLM(nn.Module):
    """Decoder + LM head. `forward(batch, pool)` -> (R, vocab) float32 logits of batch rows.

    `backend` is chosen at load (`use_kernels`, after `pack_weights`): the native kernels where
    they apply, or the PyTorch reference path; see backend.py for which path runs when."""

    inv_freq: torch.Tensor  # (head_dim / 2,) rope frequencies, a buffer

    def __init__(self, config: ArchConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = Decoder(config, dtype)
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, tied)
        self.register_buffer(
            "inv_freq", inverse_frequencies(config.rope, config.head_dim), persistent=False
        )
        self.backend = PYTORCH

    def use_kernels(self, kernels: native.Kernels | None) -> Backend:
        """Choose the backend: these native kernels where they apply (Backend.choose), else
        (or with None) the PyTorch path. Called at load; again only to compare paths."""
        self.backend = Backend.choose(self, kernels)
        for module in self.modules():
            if isinstance(module, Linear):
                module.skinny_kernels = None if module.skinny is None else self.backend.kernels
                module.native_rows = self.backend.native_linear_rows
        return self.backend

    @property
    def native_kernels(self) -> bool:
        """Whether the native kernels run (use_kernels chooses)."""
        return self.backend.kernels is not None

    def pack_weights(self, kernels: native.Kernels | None) -> bool:
        """Pack every Linear for oneDNN when the device and dtype allow and it pays on this CPU
        (backend.onednn_packs), and, with `kernels`, for the skinny kernel too; then choose the
        backend for them. True if packed."""
        weight = self.model.embed_tokens.weight
        if not packed_linear.can_pack(weight.device, weight.dtype):
            return False
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        arena = None
        if kernels is not None:  # every skinny weight in one huge-page allocation: streamed
            sizes = [
                hugepages.Arena.size_of(m.weight.numel(), m.weight.dtype)
                for m in linears
                if native.can_pack_skinny(m.weight)
            ]
            arena = hugepages.Arena(sum(sizes))
        onednn = onednn_packs(kernels)
        for module in linears:
            module.pack(kernels, arena, onednn)
        self.use_kernels(kernels)  # a fused decode step holds the packed weights' addresses
        return True

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        self._check_fits(batch, pool)
        c = self.config
        backend = self.backend.for_pool(pool)
        kernels = backend.kernels
        h = self.model.embed_tokens(batch.input_ids)  # (T, hidden)
        plan = AttentionPlan.build(batch, c.num_kv_heads, c.head_dim, pool.dtype, kernels)
        # the native rope_store computes in float32 whatever the model's dtype
        rope_dtype = torch.float32 if kernels is not None and not c.qk_norm else h.dtype
        rope = rope_cos_sin(batch.positions, self.inv_freq, rope_dtype)
        fused = backend.fused is not None and batch.is_pure_decode
        # a batch larger than skinny_linear takes (the only matmul decode_step.c has) loops
        if fused and plan.decode is not None and h.shape[0] <= backend.native_linear_rows:
            layout = plan.decode.layout
            assert layout is not None and backend.fused is not None  # native kernels
            x = backend.fused.run(h, rope, batch.out_slots, layout, pool)
        else:
            ctx = ForwardContext(backend, plan, rope, batch.out_slots, pool)
            hidden, residual = h, None
            for layer in self.model.layers:
                hidden, residual = layer(hidden, residual, ctx)
            assert residual is not None  # a model has layers
            x = self.model.norm.add_forward(residual, hidden, kernels)
        if x.shape[0] != batch.logits_indices.numel():  # not every row's logits are wanted
            x = x.index_select(0, batch.logits_indices)  # (R, hidden), normed
        return self.lm_head(x).float()  # (R, vocab)

    def _check_fits(self, batch: ForwardBatch, pool: KVPool) -> None:
        c = self.config
        longest = max(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens))
        if longest > c.max_context_len:
            raise ValueError(
                f"sequence of {longest} tokens exceeds the model's context of "
                f"{c.max_context_len} tokens"
            )
        pool_shape = (pool.num_layers, pool.num_kv_heads, pool.head_dim)
        if pool_shape != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"KV pool shaped (layers, kv_heads, head_dim) = {pool_shape}, the model needs "
                f"{(c.num_layers, c.num_kv_heads, c.head_dim)}"
            )
