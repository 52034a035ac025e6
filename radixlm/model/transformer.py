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
from radixlm.model.attention import AttentionPlan
from radixlm.model.backend import PYTORCH, Backend, onednn_packs
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.quant import QuantWeight
from radixlm.model.rope import inverse_frequencies, rope_cos_sin

# Hugging Face projection name -> (our stacked parameter, index of its block in the stack)
FUSED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Linear(nn.Module):
    """y = x W^T (+ b), W (out, in), allocated uninitialized (the loader fills it). The model's
    backend multiplies it (Backend.linear, by backend.matmul_route); `forward` is the PyTorch
    path, for callers outside a forward.

    W is held in one of these formats: dense; after `pack`, in oneDNN's layout (where that pays,
    backend.onednn_packs) and, with the native kernels, also in the skinny kernel's (`skinny`),
    a second copy, memory for speed; or as quantized blocks (`quant`, from a GGUF file or
    --quantize), the only copy: `weight` is then an empty placeholder."""

    skinny: torch.Tensor | None = None  # W for native.Kernels.skinny_linear
    quant: QuantWeight | None = None  # W as integer blocks for the quantized kernels

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
        return PYTORCH.linear(self, x)

    def pack(
        self,
        kernels: native.Kernels | None = None,
        arena: hugepages.Arena | None = None,
        onednn: bool = True,
    ) -> None:
        """Hold the weight in oneDNN's blocked layout (see packed_linear) if `onednn`; unties a
        tied one either way. With `kernels`, also keep it in the skinny kernel's layout (in
        `arena` if given). A quantized weight stays as it is."""
        if self.quant is not None:
            return
        if kernels is not None:
            self.skinny = native.pack_skinny(self.weight, arena)
        dense = self.weight.detach().contiguous()
        self.weight = nn.Parameter(packed_linear.pack_weight(dense) if onednn else dense, False)


class Embedding(nn.Module):
    """Token embeddings: rows of a float weight, or rows dequantized from quantized blocks
    (`quant`, shared with a tied LM head)."""

    quant: QuantWeight | None = None

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype), False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.dequantize_rows(input_ids).to(self.weight.dtype)
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


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
        backend = ctx.backend
        qkv = backend.linear(self.qkv_proj, x)  # (T, q_size + 2 * kv_size)
        roped = backend.rope_store(self, qkv, ctx)
        out = backend.attend(roped, ctx.pool.layer(self.layer_id), ctx.plan)
        return backend.linear(self.o_proj, out)


class MLP(nn.Module):
    def __init__(self, config: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.split_sizes = [config.intermediate_size, config.intermediate_size]
        bias = config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        gate_up = backend.linear(self.gate_up_proj, x)  # (T, 2 I)
        return backend.linear(self.down_proj, backend.silu_mul(gate_up))


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
        backend, norm1, norm2 = ctx.backend, self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual = hidden
            x = backend.add_rms_norm(residual, None, norm1.weight, norm1.eps)
        else:
            x = backend.add_rms_norm(residual, hidden, norm1.weight, norm1.eps)
        attn = self.self_attn(x, ctx)
        x = backend.add_rms_norm(residual, attn, norm2.weight, norm2.eps)
        return self.mlp(x, backend), residual


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
                if m.quant is None and native.can_pack_skinny(m.weight)
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
        h = backend.embed(self.model.embed_tokens, batch.input_ids)  # (T, hidden)
        plan = backend.plan(batch, c.num_heads, c.num_kv_heads, c.head_dim, pool.dtype)
        rope_dtype = backend.rope_dtype(h.dtype, c.qk_norm)
        rope = rope_cos_sin(batch.positions, self.inv_freq, rope_dtype)
        x = backend.decode_layers(h, rope, batch, plan, pool)
        if x is None:  # the layer loop
            ctx = ForwardContext(backend, plan, rope, batch.out_slots, pool)
            hidden, residual = h, None
            for layer in self.model.layers:
                hidden, residual = layer(hidden, residual, ctx)
            assert residual is not None  # a model has layers
            norm = self.model.norm
            x = backend.add_rms_norm(residual, hidden, norm.weight, norm.eps)
        if x.shape[0] != batch.logits_indices.numel():  # not every row's logits are wanted
            x = x.index_select(0, batch.logits_indices)  # (R, hidden), normed
        return backend.linear(self.lm_head, x).float()  # (R, vocab)

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
