"""Reading a GGUF file as if it were a Hugging Face checkpoint: a config dict and named weights.

GGUF metadata becomes a `config.json`-style dict (so `ArchConfig.from_hf` validates both
formats the same way) and GGUF tensor names are renamed to Hugging Face ones through
`GGUF_TO_HF`. Weights are dequantized to float32 with the `gguf` package, except those the
caller keeps as integer blocks (quant/blocks.py), which are decoded but not dequantized.

One trap: llama.cpp's converter permutes the rows of q_proj and k_proj of `llama` models so
that its rope can rotate adjacent pairs (x0, x1), (x2, x3), ...; our rope, like Hugging Face's,
rotates the two halves of each head. `_unpermute_rope_rows` undoes that permutation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import torch

from radixlm.model.quant.blocks import QUANT_TYPES, FileBlocks

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")


class GGUFCheckpoint:
    """An open GGUF file: `hf_config()` and `weights()` in Hugging Face terms."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        self.path = path
        self.reader = gguf.GGUFReader(path)
        self.arch = str(self._field("general.architecture"))
        if self.arch not in SUPPORTED_GGUF_ARCHS:
            raise ValueError(
                f"unsupported GGUF architecture {self.arch!r} in {path}; "
                f"radixlm reads {', '.join(SUPPORTED_GGUF_ARCHS)}"
            )
        self.tensor_names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensor_names:
            raise ValueError(
                f"{path}: per-frequency rope factors (Llama 3.1 rope scaling in GGUF) are not "
                "supported yet; load the Hugging Face checkpoint directory instead"
            )

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config dict."""
        a = self.arch
        num_heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        context_len = int(self._field(f"{a}.context_length"))
        vocab = self._field(f"{a}.vocab_size", None)
        if vocab is None:
            vocab = len(self._field("tokenizer.ggml.tokens"))
        window = self._field(f"{a}.attention.sliding_window", None)
        return {
            "model_type": a,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self._field(f"{a}.block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", num_heads)),
            "head_dim": int(self._field(f"{a}.attention.key_length", hidden // num_heads)),
            "max_position_embeddings": context_len,
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_parameters": self._rope_parameters(),
            "sliding_window": window,
            "use_sliding_window": window is not None,
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            # GGUF has no bias flags; the tensors themselves say.
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            "mlp_bias": "blk.0.ffn_up.bias" in self.tensor_names,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id", None),
        }

    def quantized(self) -> dict[str, str]:
        """Hugging Face name -> GGUF type of every 2-D tensor in a type the quantized kernels
        run (blocks.QUANT_TYPES)."""
        return {
            hf_name(t.name): t.tensor_type.name
            for t in self.reader.tensors
            if t.tensor_type.name in QUANT_TYPES and len(t.shape) == 2
        }

    def weights(
        self, keep_blocks: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
        """(Hugging Face name, float32 tensor) for every tensor, dequantized one at a time; or
        (name, FileBlocks: the file's bytes, not decoded) for the quantized ones
        `keep_blocks(name)` asks to keep."""
        num_heads = int(self._field(f"{self.arch}.attention.head_count"))
        num_kv_heads = int(self._field(f"{self.arch}.attention.head_count_kv", num_heads))
        quantized = self.quantized()
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            heads = None
            if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                heads = num_heads
            elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                heads = num_kv_heads
            shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dims fastest-first
            if keep_blocks is not None and name in quantized and keep_blocks(name):
                rows, cols = shape
                order = None
                if heads is not None:  # rope's row order, on whole rows of blocks
                    order = np.ascontiguousarray(_unpermute_rope_rows(np.arange(rows), heads))
                raw = np.asarray(tensor.data).view(np.uint8)
                yield name, FileBlocks(raw, tensor.tensor_type, (rows, cols), order)
                continue
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError as e:
                raise ValueError(
                    f"{self.path}: tensor {tensor.name} has unsupported quantization type "
                    f"{tensor.tensor_type.name}"
                ) from e
            array = array.reshape(shape)
            if heads is not None:
                array = _unpermute_rope_rows(array, heads)
            array = np.ascontiguousarray(array, dtype=np.float32)
            if not array.flags.writeable:  # F32 tensors are views of the read-only mmap
                array = array.copy()
            yield name, torch.from_numpy(array)

    def _rope_parameters(self) -> dict[str, Any]:
        a = self.arch
        params: dict[str, Any] = {"rope_theta": float(self._field(f"{a}.rope.freq_base", 1e4))}
        kind = self._field(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            params.update(rope_type="linear", factor=float(self._field(f"{a}.rope.scaling.factor")))
        elif kind == "none":
            params["rope_type"] = "default"
        else:
            params["rope_type"] = f"gguf:{kind}"  # ArchConfig refuses it with a clear message
        return params

    def _field(self, key: str, default: Any = ...) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        value = field.contents()
        return value


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in GGUF_TO_HF:
            return f"model.layers.{layer}.{GGUF_TO_HF[part]}.{suffix}"
    elif base in GGUF_GLOBAL_TO_HF:
        return f"{GGUF_GLOBAL_TO_HF[base]}.{suffix}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def rope_permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does: per head, interleave the two halves of the rows."""
    head_dim = w.shape[0] // num_heads
    halves = w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:])  # (heads, half, D/2, ...)
    return halves.swapaxes(1, 2).reshape(w.shape)  # rows: h0[0], h1[0], h0[1], h1[1], ...


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of `rope_permute_rows`: pairs (h0[i], h1[i]) back into two halves."""
    head_dim = w.shape[0] // num_heads
    pairs = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])  # (heads, D/2, pair, ...)
    return pairs.swapaxes(1, 2).reshape(w.shape)
