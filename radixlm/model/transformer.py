"""The Llama-family decoder: one module tree for Llama, SmolLM2, Mistral, Qwen2 and Qwen3.

Parameter names are the Hugging Face ones (`model.layers.3.self_attn.o_proj.weight`), with two
exceptions made for speed: q/k/v projections are stacked into one `qkv_proj` and gate/up into
one `gate_up_proj`, so a layer runs 4 matmuls instead of 7. The loader fills them by name
(see `FUSED_WEIGHTS`). Parameters are allocated uninitialized: a model is always loaded.

Data flow of `CausalLM.forward(batch, pool)`, T new tokens of all requests back to back:

  input_ids (T,) -> embed (T, hidden) -> [layer] x N -> final norm -> logits rows -> lm_head
  layer: h += o_proj(attend(rope(q), rope(k) -> pool, v -> pool)); h += down(silu(gate) * up)
  (each residual add is done with the norm that follows it: RMSNorm.add_forward)

The model holds no state between calls: K/V live in the pool, everything else in the batch.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from radixlm import hugepages
from radixlm.cache.kv_pool import KVPool
from radixlm.model import native, packed_linear
from radixlm.model.arch import ArchConfig
from radixlm.model.attention import AttentionPlan, attend
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

    After `pack`, W is held in oneDNN's layout, and (with the native kernels) also in the skinny
    kernel's, which every batch then goes through: decode batches stream it ~1.4x faster than
    oneDNN, prefill chunks match oneDNN from 512 rows and beat it by 1.1-1.3x at 32-128. The
    oneDNN copy serves the PyTorch path (native kernels off): memory for speed and comparisons,
    a second copy of the weights."""

    skinny: torch.Tensor | None = None  # W for native.Kernels.skinny_linear
    skinny_kernels: native.Kernels | None = None  # set while the model uses the native kernels

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
        rows = x.dim() == 2 and x.shape[0] > 0
        if (
            kernels is not None
            and skinny is not None
            and rows
            and x.dtype == skinny.dtype
            and kernels.runs_linear(x.shape[0], self.weight.is_mkldnn)
        ):
            y = kernels.skinny_linear(x.contiguous(), skinny)
            return y if self.bias is None else y + self.bias
        return packed_linear.linear(x, self.weight, self.bias)

    def pack(
        self, kernels: native.Kernels | None = None, arena: hugepages.Arena | None = None
    ) -> None:
        """Hold the weight in oneDNN's blocked layout (see packed_linear); unties a tied one.
        With `kernels`, also keep it in the skinny kernel's layout (in `arena` if given), which
        forward then uses."""
        if kernels is not None:
            self.skinny = native.pack_skinny(self.weight, arena)
            self.skinny_kernels = kernels if self.skinny is not None else None
        self.weight = nn.Parameter(packed_linear.pack_weight(self.weight), False)


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
        if kernels is not None and h.dtype in native.KV_DTYPES and h.device.type == "cpu":
            return kernels.add_rms_norm(h, delta, self.weight, self.eps)
        if delta is not None:
            h += delta
        return self(h)


class Attention(nn.Module):
    def __init__(self, config: ArchConfig, dtype: torch.dtype):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.split_sizes = [c.q_size, c.kv_size, c.kv_size]
        self.qkv_proj = Linear(c.hidden_size, c.q_size + 2 * c.kv_size, c.qkv_bias, dtype)
        self.o_proj = Linear(c.q_size, c.hidden_size, c.o_bias, dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype) if c.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """K/V of every token of x into the pool; the attention output (T, hidden), or with
        `rows` (native kernels only) that of those rows, (R, hidden), `plan` being theirs
        (AttentionPlan.last_rows)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        k_cache, v_cache = kv
        if plan.kernels is not None and self.q_norm is None:
            # rope on q and k, and the K/V write into the pool, in one native call (float32
            # cos/sin: see CausalLM.forward)
            q = plan.kernels.rope_store(qkv, rope, out_slots, k_cache, v_cache, self.num_heads)
            if rows is not None:
                q = q.index_select(0, rows)
            return self.o_proj(attend(q, None, None, k_cache, v_cache, plan))
        assert rows is None  # see CausalLM._row_plan
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, heads, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, kv_heads, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, kv_heads, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_cache.index_copy_(0, out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, out_slots, v.to(v_cache.dtype))
        return self.o_proj(attend(q, k, v, k_cache, v_cache, plan))


class MLP(nn.Module):
    def __init__(self, config: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.split_sizes = [config.intermediate_size, config.intermediate_size]
        bias = config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor, kernels: native.Kernels | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels is not None and gate_up.dtype in native.KV_DTYPES and gate_up.is_contiguous():
            return self.down_proj(kernels.silu_mul(gate_up))  # one native call
        gate, up = gate_up.split(self.split_sizes, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        next_norm: RMSNorm,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x = input_layernorm(h), already applied; h, the residual stream, is updated in
        place. Returns next_norm(h): the next layer's input norm, or the final norm.

        With `rows` (the last layer of a prefill chunk: only the rows whose logits are wanted
        go on; native kernels only, `plan` for those rows): every new token's K and V still go
        to the pool, the rest runs on the rows alone; returns next_norm(h)[rows] (R, hidden)
        and leaves h as it was."""
        attn = self.self_attn(x, rope, out_slots, kv, plan, rows)
        if rows is not None:
            h = h.index_select(0, rows)
        x = self.post_attention_layernorm.add_forward(h, attn, plan.kernels)
        return next_norm.add_forward(h, self.mlp(x, plan.kernels), plan.kernels)


class Decoder(nn.Module):
    """The Hugging Face `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ArchConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class FusedDecode:
    """A pure decode step's layer loop as one native call (csrc/decode_step.c): the same kernels
    in the same order as the Python loop, so the same bits, without ~270 calls' worth of module,
    ctypes and tensor glue per step. Built for models it can run: no biases or q/k norms, and
    every projection packed for the skinny kernel in the model's dtype. It holds the weights'
    addresses: CausalLM drops it when weights are packed or the kernels switched (the pool's
    addresses come from the pool at every call)."""

    def __init__(self, model: CausalLM, kernels: native.Kernels):
        c = model.config
        self.kernels = kernels
        self.shape = native.DecoderShape(
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.rms_norm_eps,
        )  # fmt: skip
        self.final_norm = model.model.norm.weight
        rows = []  # per layer, the 6 weight addresses in decode_step.c's column order
        for layer in cast(list[DecoderLayer], list(model.model.layers)):
            a, mlp = layer.self_attn, layer.mlp
            packed = [p.skinny for p in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            assert all(w is not None for w in packed)  # see `applies`
            qkv, o, gate_up, down = cast(list[torch.Tensor], packed)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            rows.append([t.data_ptr() for t in (norms[0], qkv, o, norms[1], gate_up, down)])
        self.weights = torch.tensor(rows, dtype=torch.int64)  # (num_layers, 6)

    @staticmethod
    def applies(model: CausalLM) -> bool:
        c = model.config
        dtype = model.model.embed_tokens.weight.dtype
        if c.qk_norm or c.qkv_bias or c.o_bias or c.mlp_bias or dtype not in native.KV_DTYPES:
            return False
        for layer in cast(list[DecoderLayer], list(model.model.layers)):
            a, mlp = layer.self_attn, layer.mlp
            for linear in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if linear.skinny is None or linear.skinny.dtype != dtype:
                    return False
        return True

    def run(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        out_slots: torch.Tensor,
        layout: native.DecodeLayout,
        pool: KVPool,
    ) -> torch.Tensor:
        """h (B, hidden) embeddings -> the final norm's output (B, hidden); h ends as the
        residual stream, as after the Python loop."""
        return self.kernels.decode_layers(
            h, self.weights, pool.layer_addresses(), pool.kv_strides(), self.final_norm,
            self.shape, rope, out_slots, pool.dtype, layout,
        )  # fmt: skip


class CausalLM(nn.Module):
    """Decoder + LM head. `forward(batch, pool)` -> (R, vocab) float32 logits of batch rows.

    `native_kernels`: use the native kernels (native.py) where they apply (a float32 or
    bfloat16 pool on CPU) and could be built: attention, rope + K/V store, add + norm, SiLU, and
    decode-sized matmuls; False keeps every step on PyTorch ops and oneDNN (for comparisons).
    With them, a pure decode step runs its layer loop in C (FusedDecode; `fuse_decode` False
    keeps it in Python, the same kernels one module at a time)."""

    inv_freq: torch.Tensor  # (head_dim / 2,) rope frequencies, a buffer
    _native_kernels: bool = True
    fuse_decode: bool = True  # pure decode steps through FusedDecode where it applies
    trim_last_layer: bool = True  # prefill chunks: the last layer on the logits rows only
    _fused: FusedDecode | bool | None = False  # False: not built yet; None: does not apply

    def __init__(self, config: ArchConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = Decoder(config, dtype)
        tied = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, tied)
        self.register_buffer(
            "inv_freq", inverse_frequencies(config.rope, config.head_dim), persistent=False
        )

    @property
    def native_kernels(self) -> bool:
        return self._native_kernels

    @native_kernels.setter
    def native_kernels(self, on: bool) -> None:
        self._native_kernels = on
        self._fused = False
        kernels = native.kernels() if on else None
        for module in self.modules():
            if isinstance(module, Linear) and module.skinny is not None:
                module.skinny_kernels = kernels

    def pack_weights(self) -> bool:
        """Pack every Linear for oneDNN when the device and dtype allow (and for the skinny
        kernel, with the native kernels); True if packed."""
        weight = self.model.embed_tokens.weight
        if not packed_linear.can_pack(weight.device, weight.dtype):
            return False
        kernels = native.kernels() if self.native_kernels else None
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        arena = None
        if kernels is not None:  # every skinny weight in one huge-page allocation: streamed
            sizes = [
                hugepages.Arena.size_of(m.weight.numel(), m.weight.dtype)
                for m in linears
                if native.can_pack_skinny(m.weight)
            ]
            arena = hugepages.Arena(sum(sizes))
        for module in linears:
            module.pack(kernels, arena)
        self._fused = False
        return True

    def fused_decode(self) -> FusedDecode | None:
        """The native decode step (FusedDecode), when this model's weights allow it."""
        if not self.fuse_decode:
            return None
        if self._fused is False:
            kernels = native.kernels() if self.native_kernels else None
            ok = kernels is not None and FusedDecode.applies(self)
            self._fused = FusedDecode(self, kernels) if kernels is not None and ok else None
        return self._fused if isinstance(self._fused, FusedDecode) else None

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        self._check_fits(batch, pool)
        c = self.config
        h = self.model.embed_tokens(batch.input_ids)  # (T, hidden)
        kernels = None
        if self.native_kernels and h.device.type == "cpu" and pool.dtype in native.KV_DTYPES:
            kernels = native.kernels()
        plan = AttentionPlan.build(batch, c.num_kv_heads, c.head_dim, pool.dtype, kernels)
        # the native rope_store computes in float32 whatever the model's dtype
        rope_dtype = torch.float32 if plan.kernels is not None and not c.qk_norm else h.dtype
        rope = rope_cos_sin(batch.positions, self.inv_freq, rope_dtype)
        fused = self.fused_decode() if plan.kernels is not None else None
        group = plan.decode
        if (
            fused is not None
            and group is not None
            and group.token_rows is None  # a pure decode step
            and group.layout is not None
        ):
            x = fused.run(h, rope, batch.out_slots, group.layout, pool)
        else:
            x = self._layers(h, rope, batch, pool, plan)
        if x.shape[0] != batch.logits_indices.numel():  # not trimmed to the logits rows
            x = x.index_select(0, batch.logits_indices)  # (R, hidden), normed
        return self.lm_head(x).float()  # (R, vocab)

    def _layers(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        pool: KVPool,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """The decoder layers, one module at a time: h (T, hidden) embeddings -> final norm,
        (T, hidden), or (R, hidden) for the logits rows when the last layer was trimmed."""
        layers = cast(list[DecoderLayer], list(self.model.layers))
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        row_plan = self._row_plan(batch, plan)
        x = layers[0].input_layernorm.add_forward(h, None, plan.kernels)
        for i, (layer, next_norm) in enumerate(zip(layers, next_norms)):
            kv = (pool.k_cache(i), pool.v_cache(i))
            if row_plan is not None and i == len(layers) - 1:
                rows = batch.logits_indices
                return layer(x, h, rope, batch.out_slots, kv, row_plan, next_norm, rows)
            x = layer(x, h, rope, batch.out_slots, kv, plan, next_norm)
        return x

    def _row_plan(self, batch: ForwardBatch, plan: AttentionPlan) -> AttentionPlan | None:
        """Trimming the last layer: after its K/V, only the rows whose logits are wanted matter,
        one per request in a prefill chunk of T tokens, so its attention output, o_proj, MLP and
        norm run on R rows instead of T (3% of a 512-token chunk's work on the default model).
        The attention plan for those rows, or None where it does not apply: every row wanted
        (decode, or all logits), `trim_last_layer` off, or no native kernels (or q/k norms,
        which their rope_store does not do)."""
        rows = batch.logits_indices.numel()
        if not self.trim_last_layer or plan.kernels is None or self.config.qk_norm:
            return None
        if rows != batch.batch_size or rows == batch.num_tokens:
            return None
        return plan.last_rows(batch)

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
