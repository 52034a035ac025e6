"""Which kernels a model runs: chosen once when the model is loaded, then passed down.

`Backend.choose(model, kernels)` decides it from the model (device, dtype, head size, biases,
how its weights are packed) and the process's native kernels (native.kernels(): the CPU's
variant, or None with RADIXLM_NATIVE=0 or no compiler). Three forward paths follow from it:

    native fused decode   a pure decode step's whole layer loop in one C call (FusedDecode)
    native extend         any other step: one module at a time, the native kernels inside
                          (attention, rope + K/V store, add + norm, SiLU, skinny matmuls)
    PyTorch reference     Backend() (no kernels): PyTorch ops, oneDNN matmuls, SDPA

Matmuls go by their number of rows, a rule fixed at load per variant (`onednn_packs`, then
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from radixlm.cache.kv_pool import KVPool
from radixlm.config import DType
from radixlm.model import native, native_build

if TYPE_CHECKING:
    from radixlm.model.transformer import CausalLM, DecoderLayer


class FusedDecode:
    """A pure decode step's layer loop as one native call (csrc/decode_step.c): the same kernels
    in the same order as the Python loop, so the same bits, without ~270 calls' worth of module,
    ctypes and tensor glue per step. Built for models it can run: no biases or q/k norms, and
    every projection packed for the skinny kernel in the model's dtype. It holds the weights'
    addresses, so it is built after packing (the pool's addresses come with every call)."""

    def __init__(self, model: CausalLM, kernels: native.Kernels):
        c = model.config
        self.kernels = kernels
        self.shape = native.DecoderShape(
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.rms_norm_eps,
        )  # fmt: skip
        self.final_norm = model.model.norm.weight
        rows = []  # per layer, the 6 weight addresses in decode_step.c's column order
        for layer in cast("list[DecoderLayer]", list(model.model.layers)):
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
        for layer in cast("list[DecoderLayer]", list(model.model.layers)):
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


@dataclass(frozen=True)
class Backend:
    """The kernels one model runs. `Backend()` is the PyTorch reference path."""

    kernels: native.Kernels | None = None  # the native kernels, or None: PyTorch ops
    fused: FusedDecode | None = None  # pure decode steps in one native call, where it applies
    # matmuls of up to this many rows go through skinny_linear, larger ones through the weight's
    # own path (oneDNN for a packed weight, else F.linear); 0 without kernels
    native_linear_rows: int = 0

    @classmethod
    def choose(cls, model: CausalLM, kernels: native.Kernels | None) -> Backend:
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
            return cls()
        fused = FusedDecode(model, kernels) if FusedDecode.applies(model) else None
        return cls(kernels, fused, _native_linear_rows(model, kernels))

    def for_pool(self, pool: KVPool) -> Backend:
        """This backend for a forward over `pool`: the PyTorch path where the kernels cannot
        read its K/V (a float16 pool)."""
        return self if pool.dtype in native.KV_DTYPES else PYTORCH


PYTORCH = Backend()
ALL_ROWS = sys.maxsize


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
