"""Which kernels a model runs: a Backend object chosen once when the model is loaded, then
handed to every layer, which calls its methods (plan, embed, rope_store, attend, add_rms_norm,
silu_mul, linear, decode_layers) and never asks which backend it holds.

`Backend.choose(model, kernels)` decides it from the model (device, dtype, head size, biases,
how its weights are packed) and the process's native kernels (native.kernels(): the CPU's
variant, or None with RADIXLM_NATIVE=0 or no compiler):

    NativeBackend   csrc/ kernels; a pure decode step's whole layer loop in one C call where it
                    applies (FusedDecode), else one module at a time with the kernels inside
    TorchBackend    the reference: PyTorch ops, oneDNN matmuls, SDPA over gathered K/V

Quantized weights (quant/) go to the integer kernels at every row count. Float matmuls go by
their number of rows (`matmul_route`), a rule fixed at load per variant (`onednn_packs`, then
`Backend.native_linear_rows` from Kernels.runs_linear):

    up to 16 rows       skinny_linear streams the weight, on every variant
    17-64 rows          generic: F.linear on dense weights (MKL's sgemm); others: skinny_linear
    more (prefill)      generic: F.linear on dense weights
                        avx512 and avx2: skinny_linear's register tiles, which match or
                        beat oneDNN's matmuls at their instruction set (Kernels.runs_linear)

and where oneDNN cannot pack the weights' dtype (bfloat16 without AVX512-BW), skinny_linear
takes every row: PyTorch's dense bfloat16 matmuls are slower still. The PyTorch path packs for
oneDNN by the same rule (`onednn_packs`), so on generic it multiplies as transformers does.

Nothing in a forward re-derives this from flags; the questions a forward still asks are
whether its pool holds K/V the kernels read (`for_pool`) and how many rows a matmul has.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn.functional as F

from radixlm.cache import kv_quant
from radixlm.cache.kv_pool import KVPool, LayerKV
from radixlm.config import DType
from radixlm.model import native, native_build, packed_linear
from radixlm.model.attention import AttentionPlan, attend_native, attend_torch
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.quant import reference as quant_reference
from radixlm.model.rope import apply_rope

if TYPE_CHECKING:
    from radixlm.model.transformer import (
        Attention,
        CausalLM,
        DecoderLayer,
        Embedding,
        ForwardContext,
        Linear,
    )


class FusedDecode:
    """A pure decode step's layer loop as one native call (csrc/decode_step.c): the same kernels
    in the same order as the Python loop, so the same bits, without ~270 calls' worth of module,
    ctypes and tensor glue per step. Built for models it can run: no biases or q/k norms, and
    every projection either packed for the skinny kernel in the model's dtype or held as
    quantized blocks (`quant`: then each matmul's address is a descriptor of its parts). It
    holds the weights' addresses, so it is built after packing (the pool's come with every
    call)."""

    def __init__(self, model: CausalLM, kernels: native.Kernels):
        c = model.config
        self.kernels = kernels
        self.shape = native.DecoderShape(
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.rms_norm_eps,
        )  # fmt: skip
        self.final_norm = model.model.norm.weight
        self.quant = _projections(model)[0].quant is not None
        self.descriptors: list[torch.Tensor] = []  # kept alive: decode_step.c reads them
        rows = []  # per layer, the 6 weight addresses in decode_step.c's column order
        for layer in cast("list[DecoderLayer]", list(model.model.layers)):
            a, mlp = layer.self_attn, layer.mlp
            matmuls = [self._address(p) for p in (a.qkv_proj, a.o_proj, mlp.gate_up_proj,
                                                  mlp.down_proj)]  # fmt: skip
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            qkv, o, gate_up, down = matmuls
            rows.append([norms[0].data_ptr(), qkv, o, norms[1].data_ptr(), gate_up, down])
        self.weights = torch.tensor(rows, dtype=torch.int64)  # (num_layers, 6)

    def _address(self, linear: Linear) -> int:
        if linear.quant is None:
            assert linear.skinny is not None  # see `applies`
            return linear.skinny.data_ptr()
        q = linear.quant
        fields = [int(q.mode == "fast"), len(q.parts)]
        for p in q.parts:
            fields += [
                p.records.data_ptr(), p.out_features, p.start, p.bits, p.sub, p.has_min, p.kscale
            ]  # fmt: skip
        descriptor = torch.tensor(fields, dtype=torch.int64)
        self.descriptors.append(descriptor)
        return descriptor.data_ptr()

    @staticmethod
    def applies(model: CausalLM) -> bool:
        c = model.config
        dtype = model.model.embed_tokens.weight.dtype
        if c.qk_norm or c.qkv_bias or c.o_bias or c.mlp_bias or dtype not in native.KV_DTYPES:
            return False
        projections = _projections(model)
        if all(p.quant is not None for p in projections):
            return True
        return all(p.skinny is not None and p.skinny.dtype == dtype for p in projections)

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
            self.shape, rope, out_slots, pool.dtype, layout, self.quant, pool.scale_strides(),
        )  # fmt: skip


def _projections(model: CausalLM) -> list[Linear]:
    """Every decoder layer's four matmuls."""
    out = []
    for layer in cast("list[DecoderLayer]", list(model.model.layers)):
        a, mlp = layer.self_attn, layer.mlp
        out += [a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out


class Route(Enum):
    """Who multiplies one matmul (`matmul_route`)."""

    SKINNY = "skinny"  # native skinny_linear on the packed float weight (streams or tiles)
    PYTORCH = "pytorch"  # oneDNN on a packed weight, else F.linear on the dense one
    QUANT = "quant"  # integer kernels on quantized blocks (quant/)


def matmul_route(linear: Linear, num_rows: int, native_rows: int) -> Route:
    """The one rule for who multiplies `num_rows` rows by `linear`'s weight, given the backend's
    `native_linear_rows` (0 without kernels):

        quantized blocks                     QUANT, at every row count (one accumulation order:
                                             decode, prefill, batched and alone give the same bits)
        packed float, rows <= native_rows    SKINNY (native_linear_rows: see the module's table)
        otherwise                            PYTORCH (oneDNN where packed, else F.linear)
    """
    if linear.quant is not None:
        return Route.QUANT
    if linear.skinny is not None and 0 < num_rows <= native_rows:
        return Route.SKINNY
    return Route.PYTORCH


@dataclass(frozen=True)
class Backend(ABC):
    """The kernels one model runs, handed to every layer in its ForwardContext. The layers call
    these methods and never ask which backend they hold: `TorchBackend` (PyTorch ops, the
    reference) or `NativeBackend` (csrc/ kernels)."""

    kernels: native.Kernels | None = None  # the native kernels, or None: PyTorch ops
    fused: FusedDecode | None = None  # pure decode steps in one native call, where it applies
    # matmuls of up to this many rows go through skinny_linear (matmul_route); 0 without kernels
    native_linear_rows: int = 0

    @staticmethod
    def choose(model: CausalLM, kernels: native.Kernels | None) -> Backend:
        """The native kernels for a float32 or bfloat16 model on CPU whose head size they take
        (a multiple of 16, at most MAX_HEAD_DIM: whole vectors); else the PyTorch path."""
        c = model.config
        weight = model.model.embed_tokens.weight
        if (
            kernels is None
            or weight.device.type != "cpu"
            or weight.dtype not in native.KV_DTYPES
            or c.head_dim % 16 != 0
            or c.head_dim > native.MAX_HEAD_DIM
        ):
            return TorchBackend()
        fused = FusedDecode(model, kernels) if FusedDecode.applies(model) else None
        return NativeBackend(kernels, fused, _native_linear_rows(model, kernels))

    @abstractmethod
    def for_pool(self, pool: KVPool) -> Backend:
        """This backend for a forward over `pool` (the PyTorch path where the kernels cannot
        read its K/V: a float16 pool; they read float32, bfloat16 and int8 ones)."""

    @abstractmethod
    def plan(self, batch: ForwardBatch, num_heads: int, num_kv_heads: int, head_dim: int,
             kv_dtype: torch.dtype) -> AttentionPlan:  # fmt: skip
        """The attention layout of one forward, shared by its layers."""

    @abstractmethod
    def rope_dtype(self, model_dtype: torch.dtype, qk_norm: bool) -> torch.dtype:
        """The dtype of the rope tables this backend's rope_store reads."""

    @abstractmethod
    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h += delta in place (the residual stream; no add when delta is None), then the RMS
        norm of h times weight."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up (T, 2 I), gate first -> (T, I)."""

    @abstractmethod
    def rope_store(self, attn: Attention, qkv: torch.Tensor, ctx: ForwardContext) -> RopedQKV:
        """Rotate the new tokens' q and k (after the q/k norms, if any) and write k, v into the
        pool at ctx.out_slots (an int8 pool: quantized, cache/kv_quant.py); q (T, H, D) back,
        with the fresh k, v where `attend` reads them (as the pool holds them)."""

    @abstractmethod
    def attend(self, roped: RopedQKV, kv: LayerKV, plan: AttentionPlan) -> torch.Tensor:
        """Attention output (T, heads * D) over this layer of the pool, which holds the new K/V."""

    @abstractmethod
    def linear(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) @ W^T (+ b) -> (M, out), by the route `matmul_route` names."""

    def embed(self, embedding: Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (T, hidden) of input_ids (T,), in the model's dtype."""
        return embedding(input_ids)

    def decode_layers(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
        plan: AttentionPlan, pool: KVPool,
    ) -> torch.Tensor | None:  # fmt: skip
        """A pure decode step's whole layer loop in one call -> the final norm's output, or None
        where this backend has no such call for this step (the caller runs the layer loop)."""
        return None


class RopedQKV(NamedTuple):
    """rope_store's result: rotated queries, and the fresh k, v (None where attend reads the
    pool only) with the values the pool holds (an int8 pool's: dequantized)."""

    q: torch.Tensor  # (T, H, D)
    k: torch.Tensor | None  # (T, KV, D)
    v: torch.Tensor | None


@dataclass(frozen=True)
class TorchBackend(Backend):
    """The reference path: PyTorch ops, oneDNN / F.linear matmuls, SDPA over gathered K/V."""

    def for_pool(self, pool: KVPool) -> Backend:
        return self

    def plan(self, batch: ForwardBatch, num_heads: int, num_kv_heads: int, head_dim: int,
             kv_dtype: torch.dtype) -> AttentionPlan:  # fmt: skip
        return AttentionPlan.build(batch, num_kv_heads, head_dim, kv_dtype, None,
                                   num_heads=num_heads)  # fmt: skip

    def rope_dtype(self, model_dtype: torch.dtype, qk_norm: bool) -> torch.dtype:
        return model_dtype

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if delta is not None:
            h += delta
        return F.rms_norm(h, weight.shape, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def rope_store(self, attn: Attention, qkv: torch.Tensor, ctx: ForwardContext) -> RopedQKV:
        return rope_store_torch(attn, qkv, ctx)

    def attend(self, roped: RopedQKV, kv: LayerKV, plan: AttentionPlan) -> torch.Tensor:
        assert roped.k is not None and roped.v is not None  # rope_store_torch keeps them
        return attend_torch(roped.q, roped.k, roped.v, kv, plan)

    def linear(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        if linear.quant is not None:  # the integer kernels' arithmetic, in PyTorch
            y = quant_reference.linear(x, linear.quant)
            return y if linear.bias is None else y + linear.bias
        return packed_linear.linear(x, linear.weight, linear.bias)


@dataclass(frozen=True)
class NativeBackend(Backend):
    """csrc/ kernels: attention over pool slots, rope + K/V store, add + norm, SiLU, skinny and
    quantized matmuls, and pure decode steps in one call (`fused`)."""

    kernels: native.Kernels  # never None here

    def for_pool(self, pool: KVPool) -> Backend:
        return self if pool.dtype in native.POOL_DTYPES else PYTORCH

    def plan(self, batch: ForwardBatch, num_heads: int, num_kv_heads: int, head_dim: int,
             kv_dtype: torch.dtype) -> AttentionPlan:  # fmt: skip
        return AttentionPlan.build(batch, num_kv_heads, head_dim, kv_dtype, self.kernels,
                                   num_heads=num_heads)  # fmt: skip

    def rope_dtype(self, model_dtype: torch.dtype, qk_norm: bool) -> torch.dtype:
        # the native rope_store computes in float32 whatever the model's dtype; q/k norms go
        # through PyTorch's rope (rope_store_torch) in the model's dtype
        return model_dtype if qk_norm else torch.float32

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.kernels.add_rms_norm(h, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up.contiguous())

    def rope_store(self, attn: Attention, qkv: torch.Tensor, ctx: ForwardContext) -> RopedQKV:
        if attn.q_norm is not None:  # q/k norms sit between the projection and the rope
            return rope_store_torch(attn, qkv, ctx)
        kv = ctx.pool.layer(attn.layer_id)
        q = self.kernels.rope_store(
            qkv, ctx.rope, ctx.out_slots, kv.k, kv.v, attn.num_heads, kv.scales
        )
        return RopedQKV(q, None, None)

    def attend(self, roped: RopedQKV, kv: LayerKV, plan: AttentionPlan) -> torch.Tensor:
        return attend_native(roped.q, kv, plan)

    def linear(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        route = matmul_route(linear, x.shape[0], self.native_linear_rows)
        if route is Route.QUANT:
            assert linear.quant is not None
            y = self.kernels.quant_linear(x, linear.quant)
        elif route is Route.SKINNY and linear.skinny is not None and linear.skinny.dtype == x.dtype:
            y = self.kernels.skinny_linear(x.contiguous(), linear.skinny)
        else:
            return packed_linear.linear(x, linear.weight, linear.bias)
        return y if linear.bias is None else y + linear.bias

    def embed(self, embedding: Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        if embedding.quant is None:
            return embedding(input_ids)
        return self.kernels.quant_rows(input_ids, embedding.quant, embedding.weight.dtype)

    def decode_layers(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
        plan: AttentionPlan, pool: KVPool,
    ) -> torch.Tensor | None:  # fmt: skip
        if self.fused is None or not batch.is_pure_decode or plan.decode is None:
            return None
        # a float batch larger than skinny_linear takes (decode_step.c's float matmul) loops;
        # quantized matmuls take any number of rows
        if not self.fused.quant and h.shape[0] > self.native_linear_rows:
            return None
        layout = plan.decode.layout
        assert layout is not None  # the plan was built with the kernels
        return self.fused.run(h, rope, batch.out_slots, layout, pool)


PYTORCH: Backend = TorchBackend()
ALL_ROWS = sys.maxsize


def rope_store_torch(attn: Attention, qkv: torch.Tensor, ctx: ForwardContext) -> RopedQKV:
    """PyTorch's rope (after the q/k norms, if any) and the K/V write into the pool (an int8
    pool's codes and scales by kv_quant.quantize, and k, v back as the pool holds them)."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split(attn.split_sizes, dim=-1)
    q = q.view(num_tokens, attn.num_heads, attn.head_dim)  # (T, heads, D)
    k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)  # (T, kv_heads, D)
    v = v.view(num_tokens, attn.num_kv_heads, attn.head_dim)  # (T, kv_heads, D)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, *ctx.rope), apply_rope(k, *ctx.rope)
    kv = ctx.pool.layer(attn.layer_id)
    if kv.scales is None:
        kv.k.index_copy_(0, ctx.out_slots, k.to(kv.k.dtype))
        kv.v.index_copy_(0, ctx.out_slots, v.to(kv.v.dtype))
        return RopedQKV(q, k, v)
    stored = []
    for fresh, codes, scales in ((k, kv.k, kv.scales.k), (v, kv.v, kv.scales.v)):
        new_codes, new_scales = kv_quant.quantize(fresh)  # (T, KV, D) int8, (T, KV)
        codes.index_copy_(0, ctx.out_slots, new_codes)
        scales.index_copy_(0, ctx.out_slots, new_scales)
        stored.append(kv_quant.dequantize(new_codes, new_scales, q.dtype))
    return RopedQKV(q, stored[0], stored[1])


def onednn_packs(kernels: native.Kernels | None) -> bool:
    """Whether a model's weights are packed for oneDNN on this CPU: on the variants whose
    oneDNN kernels beat F.linear on dense weights. Not on generic CPUs (no AVX2), where oneDNN's
    SSE4.1 matmuls run the model's prefill shapes slower than MKL's sgemm on dense weights, and
    its decode rows no faster. Without kernels: the variant they would run (RADIXLM_NATIVE=0
    keeps the PyTorch path on the same matmuls as the kernels' prefill)."""
    isa = kernels.isa if kernels is not None else native_build.chosen_variant().name
    return isa != "generic"


def _native_linear_rows(model: CausalLM, kernels: native.Kernels) -> int:
    """How many rows skinny_linear multiplies at most (see the module's table), and with them
    the largest decode batch the fused decode step (which has only skinny_linear) takes: decode
    batches on every variant (Kernels.runs_linear); prefill chunks where the kernels' own rule
    says their tiles beat oneDNN or nothing else is fast. Dense float32 weights (generic) go to
    F.linear past the rows skinny_linear streams: MKL's sgemm beats the generic tiles there."""
    weight = model.lm_head.weight
    if not weight.is_mkldnn and weight.dtype == torch.float32:
        return native.SKINNY_MAX_ROWS
    if kernels.runs_linear(ALL_ROWS, onednn_packed=weight.is_mkldnn):
        return ALL_ROWS
    return native.NATIVE_LINEAR_ROWS


def default_dtype(device: str) -> DType:
    """The dtype `--dtype auto` loads: bfloat16 where the native kernels have bfloat16 dot
    products (the avx512 build on a CPU with AVX512-BF16), which doubles the arithmetic rate of
    every matmul and attention tile and halves the bytes a decode step streams; float32
    everywhere else, where bfloat16 would be widened to float32 inside every kernel and
    PyTorch's own bfloat16 matmuls are slower than its float32 ones. Off CPU: float32."""
    if device != "cpu":
        return "float32"
    kernels = native.kernels()
    return "bfloat16" if kernels is not None and kernels.bf16_dots else "float32"
