"""`bench model`'s roofline: the FLOPs of a prefill, counted against the model's own modules."""

from __future__ import annotations

from pathlib import Path

import torch

from radixlm.bench.roofline import PEAK_FLOPS, matmul_peak_timer, prefill_flops
from radixlm.model.arch import ArchConfig
from radixlm.model.transformer import CausalLM, DecoderLayer, Linear

SMOLLM2 = ArchConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_context_len=8192,
    tie_word_embeddings=True,
)  # fmt: skip


def test_prefill_flops_count_every_weight_every_causal_pair_and_one_logits_row() -> None:
    config = ArchConfig(
        model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, max_context_len=64,
    )  # fmt: skip
    model = CausalLM(config)
    n = 7
    layer_weights = sum(
        m.weight.numel()
        for layer in model.model.layers
        if isinstance(layer, DecoderLayer)
        for m in layer.modules()
        if isinstance(m, Linear)
    )
    # query i sees keys 0..i: QK^T and PV each cost 2 D per (query, key) pair and head
    pairs = sum(i + 1 for i in range(n))
    attention = config.num_layers * config.num_heads * pairs * 2 * 2 * config.head_dim
    flops = prefill_flops(config, n)
    assert flops.matmuls == 2 * n * layer_weights
    assert flops.attention == attention
    assert flops.logits == 2 * model.lm_head.weight.numel()
    assert flops.total == 2 * n * layer_weights + attention + flops.logits


def test_smollm2_layers_cost_about_0_21_gflop_per_token() -> None:
    per_token = prefill_flops(SMOLLM2, 1000).matmuls / 1000
    assert 0.21e9 < per_token < 0.215e9
    # at 4,096 tokens causal attention adds two thirds again
    long = prefill_flops(SMOLLM2, 4096)
    assert 0.6 < long.attention / long.matmuls < 0.7


def test_the_matmul_peak_timer_times_one_large_linear() -> None:
    seconds = matmul_peak_timer(torch.float32)()
    assert seconds > 0 and PEAK_FLOPS / seconds > 1e8  # any CPU does 0.1 GFLOP/s


def test_a_decode_step_reads_the_quantized_records_not_the_float_weights(
    tmp_path: Path,
) -> None:
    """bench model's decode bytes: a model held as quantized records reads the records' bytes
    (and a tied LM head's whole table), a float one its weights; both read B x C tokens' K/V."""
    from test_native_kernel import require_native_kernels

    from radixlm.bench.model_speed import _decode_bytes
    from radixlm.bench.random_gguf import SHAPES, write
    from radixlm.model.loader import load_causal_lm

    require_native_kernels()
    path = write(str(tmp_path / "q4_1.gguf"), SHAPES["tiny"], "Q4_1", tokenizer_from=None)
    quantized, floats = load_causal_lm(path, quant="exact"), load_causal_lm(path, quant="float")
    records = sum(m.quant.nbytes for m in quantized.modules() if isinstance(m, Linear) and m.quant)
    kv, weights = _decode_bytes(quantized, 2, 100)
    c = quantized.config
    assert kv == 2 * 101 * 2 * c.num_layers * c.kv_size * 4
    norms = sum(p.numel() * 4 for n, p in quantized.named_parameters() if "norm" in n)
    assert weights == records + norms
    float_kv, float_weights = _decode_bytes(floats, 2, 100)
    linear_floats = sum(p.numel() for n, p in floats.named_parameters(remove_duplicate=False)
                        if n.endswith("proj.weight") or n == "lm_head.weight")  # fmt: skip
    assert float_kv == kv and float_weights == linear_floats * 4 + norms
    assert _decode_bytes(quantized, 2, 100, blocks=False) == (float_kv, float_weights)
    int8_kv, int8_weights = _decode_bytes(quantized, 2, 100, kv_dtype="int8")  # codes + scales
    assert int8_kv == 2 * 101 * 2 * c.num_layers * c.num_kv_heads * (c.head_dim + 2)
    assert int8_weights == weights
