"""GGUF files with random weights in a real model's shape: benchmarks and tests of bigger
models without downloading them (a decode step's speed does not depend on the values).

    python -m radixlm.bench.random_gguf llama-3.2-1b llama1b.gguf --type Q4_1
    python -m radixlm.bench.random_gguf llama-8b llama8b.gguf --type Q4_K_M

The tokenizer (and its chat template) is the default model's, copied from its GGUF, so
`radixlm serve` runs the file; token ids past its vocabulary are never produced by it but are
rows of the embedding like any other. Quantized types are written as the `gguf` package
quantizes random normal weights (Q4_0, Q4_1, Q8_0) or as random blocks with small scales
(Q4_K, Q5_K, Q6_K, which it cannot quantize): either is a valid file of that type.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    arch: str = "llama"
    rope_theta: float = 500_000.0


SHAPES = {
    "smollm2-135m": Shape(30, 576, 9, 3, 1536, 49152, True, rope_theta=100_000.0),
    "llama-3.2-1b": Shape(16, 2048, 32, 8, 8192, 128256, True),
    "qwen2.5-1.5b": Shape(28, 1536, 12, 2, 8960, 151936, True, True, "qwen2", 1_000_000.0),
    "llama-8b": Shape(32, 4096, 32, 8, 14336, 128256, False),
    # tests: every block type of a K-quant fits (hidden and intermediate multiples of 256)
    "tiny": Shape(2, 256, 4, 2, 512, 512, True, rope_theta=10_000.0),
    "tiny-qwen2": Shape(2, 256, 4, 2, 512, 512, True, True, "qwen2", 1_000_000.0),
}
# Q4_K_M / Q5_K_M as llama.cpp writes them: attn_v and ffn_down (half the layers) and the
# output in Q6_K, the rest in Q4_K / Q5_K.
MIXES = {
    "Q4_K_M": (T.Q4_K, T.Q6_K),
    "Q5_K_M": (T.Q5_K, T.Q6_K),
}


def tensor_types(shape: Shape, kind: str) -> dict[str, T]:
    """GGUF tensor name -> type for a file of `kind` (a GGML type name or Q4_K_M / Q5_K_M)."""
    names = ["token_embd.weight"] + ([] if shape.tied else ["output.weight"])
    for i in range(shape.num_layers):
        names += [
            f"blk.{i}.{part}.weight"
            for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                         "ffn_down")
        ]  # fmt: skip
    if kind not in MIXES:
        qtype = gguf.GGMLQuantizationType[kind]
        return dict.fromkeys(names, qtype)
    base, high = MIXES[kind]
    types = dict.fromkeys(names, base)
    for name in names:
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name.endswith(("attn_v.weight", "ffn_down.weight")) and layer % 2 == 0:
            types[name] = high
        if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
            types[name] = high
    return types


def random_tensor(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """(rows, cols) random weights in `qtype`: raw block bytes, or float32 for F32."""
    if qtype == T.F32:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0, T.F16):
        weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(weights, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    scale = np.full((blocks.shape[0], 1), 1e-4, dtype=np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        blocks[:, 208:210] = scale
    else:  # Q4_K, Q5_K: d, then dmin
        blocks[:, 0:2], blocks[:, 2:4] = scale, scale
    return raw


def write(
    path: str, shape: Shape, kind: str, seed: int = 0, tokenizer_from: str | None = "default"
) -> str:
    """Write the file; returns its path. `tokenizer_from`: a GGUF whose tokenizer metadata is
    copied ("default": the default model's; None: no tokenizer, for a model loaded alone)."""
    from radixlm.model.gguf_file import rope_permute_rows
    from radixlm.model.loader import default_model_path

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, shape.arch)
    head_dim = shape.hidden // shape.num_heads
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab)
    if tokenizer_from is not None:
        source = default_model_path() if tokenizer_from == "default" else tokenizer_from
        _copy_tokenizer(writer, source)
    q_rows, kv_rows = shape.num_heads * head_dim, shape.num_kv_heads * head_dim
    dims = {
        "token_embd": (shape.vocab, shape.hidden), "output": (shape.vocab, shape.hidden),
        "attn_q": (q_rows, shape.hidden), "attn_k": (kv_rows, shape.hidden),
        "attn_v": (kv_rows, shape.hidden), "attn_output": (shape.hidden, q_rows),
        "ffn_gate": (shape.intermediate, shape.hidden),
        "ffn_up": (shape.intermediate, shape.hidden),
        "ffn_down": (shape.hidden, shape.intermediate),
    }  # fmt: skip
    for name, qtype in tensor_types(shape, kind).items():
        part = name.split(".")[-2]
        rows, cols = dims[part]
        data = random_tensor(rows, cols, qtype, rng)
        if qtype == T.F32 and part in ("attn_q", "attn_k") and shape.arch == "llama":
            data = rope_permute_rows(
                data, shape.num_heads if part == "attn_q" else shape.num_kv_heads
            )
        writer.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)
    norms = ["output_norm.weight"]
    for i in range(shape.num_layers):
        norms += [f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight"]
        if shape.qkv_bias:
            for part, n in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                writer.add_tensor(
                    f"blk.{i}.{part}.bias", (rng.standard_normal(n) * 0.05).astype(np.float32)
                )
    for name in norms:
        writer.add_tensor(name, np.ones(shape.hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _copy_tokenizer(writer: gguf.GGUFWriter, source: str) -> None:
    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        else:
            writer.add_key_value(key, value, vtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixlm.bench.random_gguf")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path")
    parser.add_argument("--type", default="Q4_1", help="a GGML type name, Q4_K_M or Q5_K_M")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write(args.path, SHAPES[args.shape], args.type, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
