"""Loading: a GGUF file reads like the HF checkpoint it came from; bad inputs fail clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from helpers import TinyModels

from radixlm.cache.kv_pool import KVPool
from radixlm.model.arch import ArchConfig
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.gguf_file import _unpermute_rope_rows, rope_permute_rows
from radixlm.model.loader import load_causal_lm, load_model
from radixlm.model.transformer import CausalLM

EMPTY = np.zeros(0, dtype=np.int64)
IDS = [3, 17, 250, 99, 4, 4, 200, 1, 42, 7, 128, 64]


def prefill_logits(
    model: CausalLM, ids: list[int], kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    c = model.config
    dtype = kv_dtype or model.model.embed_tokens.weight.dtype
    pool = KVPool(64, c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    batch = ForwardBatch.build([ids], [EMPTY], [pool.alloc(len(ids))], all_logits=True)
    with torch.inference_mode():
        return model(batch, pool)


def write_gguf(reference: Any, path: Path, arch: str | None = None) -> Path:
    """The reference model as llama.cpp's converter would write it (F32, q/k rows permuted)."""
    cfg = reference.config
    arch = arch or cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    )
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    to_gguf = {hf: g for g, hf in GGUF_NAMES.items()}
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = rope_permute_rows(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = rope_permute_rows(array, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name, to_gguf), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
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


def _gguf_name(hf_name: str, to_gguf: dict[str, str]) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, part = module.split(".", 3)
        return f"blk.{layer}.{to_gguf[part]}.{suffix}"
    return f"{to_gguf[module]}.{suffix}"


def test_rope_permutation_round_trips() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(_unpermute_rope_rows(rope_permute_rows(w, 8), 8), w)
    assert not np.array_equal(rope_permute_rows(w, 8), w)


@pytest.mark.parametrize(
    "variant", ["llama-mha-tied-bias", "llama-mqa", "qwen2-gqa-tied", "qwen3-gqa-qknorm"]
)
def test_gguf_loads_like_its_hf_checkpoint(
    variant: str, tiny_hf_model: TinyModels, tmp_path: Path
) -> None:
    reference = tiny_hf_model(variant).reference
    model = load_causal_lm(str(write_gguf(reference, tmp_path / "tiny.gguf")))
    with torch.inference_mode():
        expected = reference(torch.tensor([IDS])).logits[0]
    assert (prefill_logits(model, IDS) - expected).abs().max() <= 1e-4


def test_load_model_returns_config_and_tokenizer(tiny_hf_model: TinyModels) -> None:
    loaded = load_model(str(tiny_hf_model("qwen2-gqa-tied").path))
    assert loaded.config.qkv_bias and loaded.config.tie_word_embeddings
    assert loaded.config.eos_token_ids == (257,)
    assert loaded.config.max_context_len == 64
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("pack_weights", [True, False])
def test_bfloat16_and_a_narrower_kv_pool(tiny_hf_model: TinyModels, pack_weights: bool) -> None:
    path = str(tiny_hf_model("llama-gqa-llama3rope").path)
    full = prefill_logits(load_causal_lm(path), IDS)
    half = load_causal_lm(path, dtype="bfloat16", pack_weights=pack_weights)
    assert (prefill_logits(half, IDS) - full).abs().max() < 0.5
    fp32_model_bf16_kv = prefill_logits(load_causal_lm(path), IDS, kv_dtype=torch.bfloat16)
    assert (fp32_model_bf16_kv - full).abs().max() < 0.5


def test_sequence_longer_than_context_is_refused(tiny_hf_model: TinyModels) -> None:
    model = load_causal_lm(str(tiny_hf_model("llama-mqa").path))  # context 64
    c = model.config
    pool = KVPool(128, c.num_layers, c.num_kv_heads, c.head_dim)
    batch = ForwardBatch.build([[1]], [pool.alloc(64)], [pool.alloc(1)])
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        model(batch, pool)


def copy_with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding-window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"intermediate_size": 80}, "checkpoint shape"),
    ],
)
def test_bad_configs_are_refused(
    tiny_hf_model: TinyModels, tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    path = copy_with_config(tiny_hf_model("llama-mqa").path, tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=message):
        load_causal_lm(str(path))


def test_missing_files(tiny_hf_model: TinyModels, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_causal_lm(str(tmp_path / "empty"))
    path = copy_with_config(tiny_hf_model("llama-mqa").path, tmp_path / "noweights")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_causal_lm(str(path))


def test_missing_weight_is_refused(tiny_hf_model: TinyModels, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = copy_with_config(tiny_hf_model("llama-mqa").path, tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights .*gate_up_proj"):
        load_causal_lm(str(path))


def test_gguf_errors(tiny_hf_model: TinyModels, tmp_path: Path) -> None:
    reference = tiny_hf_model("llama-mqa").reference
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_causal_lm(str(write_gguf(reference, tmp_path / "gpt2.gguf", arch="gpt2")))
    path = tmp_path / "f64.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length"):
        getattr(writer, f"add_{key}")(64)
    writer.add_head_count(4)
    writer.add_vocab_size(64)
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported quantization type F64"):
        load_causal_lm(str(path))


def test_bad_dtype_and_device(tiny_hf_model: TinyModels) -> None:
    path = str(tiny_hf_model("llama-mqa").path)
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(path, dtype="float64")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_causal_lm(path, device="cuda")


def test_transformers_4_config_fields() -> None:
    config = ArchConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 2048,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
            "eos_token_id": [1, 2],
        }
    )  # fmt: skip
    assert config.num_kv_heads == 4 and config.head_dim == 16
    assert config.rope.kind == "llama3" and config.rope.theta == 500000.0
    assert config.eos_token_ids == (1, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tiny_hf_model: TinyModels) -> None:
    path = str(tiny_hf_model("qwen3-gqa-qknorm").path)
    cpu = prefill_logits(load_causal_lm(path), IDS)
    model = load_causal_lm(path, device="cuda")
    c = model.config
    pool = KVPool(64, c.num_layers, c.num_kv_heads, c.head_dim, device="cuda")
    slots = pool.alloc(len(IDS))
    batch = ForwardBatch.build([IDS], [EMPTY], [slots], all_logits=True, device="cuda")
    with torch.inference_mode():
        assert (model(batch, pool).cpu() - cpu).abs().max() <= 1e-3
