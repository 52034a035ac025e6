"""Sampling with speculation keeps the model's distribution (a statistical test, seeded).

A prompt whose cached prefix leaves one token to compute and whose last tokens recur earlier in
it, so the step that samples the first output token also verifies a one-token draft d. Over many
requests at temperature 0.5 (each its own seed; p below is the model's distribution at that
temperature, softmax(logits / 0.5)): the first token follows p(. | prompt), d is kept
as often as p(d | prompt) says, and the second token of the requests that kept d, sampled from
the draft's verify row, follows p(. | prompt + d). Chi-square statistics against the model's
probabilities (from a plain prefill) stay below the 0.1 % quantile.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import assert_idle, new_engine, steady_drafts
from helpers import save_tiny_model

from radixlm.api_types import SamplingParams
from radixlm.cache.kv_pool import KVPool
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import load_causal_lm

NUM_REQUESTS = 1500
TEMPERATURE = 0.5
RUN = [17, 23, 31]  # the prompt's last tokens, found earlier in it: the draft follows them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec-sampling")
    save_tiny_model("llama-gqa-llama3rope", path, vocab_size=272, max_position_embeddings=1024)
    return path


def next_token_probs(model_dir: Path, ids: list[int]) -> np.ndarray:
    """softmax(logits / TEMPERATURE) after `ids`, from one prefill of the model."""
    model = load_causal_lm(str(model_dir))
    c = model.config
    pool = KVPool(len(ids), c.num_layers, c.num_kv_heads, c.head_dim)
    batch = ForwardBatch.build([ids], [np.zeros(0, np.int64)], [pool.alloc(len(ids))])
    with torch.inference_mode():
        logits = model(batch, pool)[0].double()
    return torch.softmax(logits / TEMPERATURE, -1).numpy()


def prompt_with_draft(model_dir: Path) -> tuple[list[int], int]:
    """A prompt ending in RUN, whose earlier RUN is followed by the model's likeliest next
    token d (so that d is often kept); the prompt and d."""
    body = [(7 * i + 3) % 250 + 1 for i in range(30)]
    draft = 0
    for _ in range(5):  # d = argmax p(. | prompt(d)): a few rounds reach a fixed point or near
        prompt = [*body, *RUN, draft, *body[:5], *RUN]
        draft = int(next_token_probs(model_dir, prompt).argmax())
    return [*body, *RUN, draft, *body[:5], *RUN], draft


def chi_square_below_quantile(counts: Counter[int], probs: np.ndarray, total: int) -> None:
    """Pearson's statistic over tokens expected at least 5 times (the rest pooled) against the
    0.1 % upper quantile of chi-square (Wilson-Hilferty)."""
    expected = probs * total
    big = expected >= 5
    observed = np.array([counts.get(t, 0) for t in range(len(probs))], dtype=np.float64)
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 3.09  # the standard normal's 0.1 % upper quantile
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, limit, dof)


def test_sampled_tokens_follow_the_model_with_speculation(model_dir: Path) -> None:
    prompt, draft = prompt_with_draft(model_dir)
    p1 = next_token_probs(model_dir, prompt)
    p2 = next_token_probs(model_dir, [*prompt, draft])
    assert p1[draft] > 0.1  # enough requests keep d for the second test
    # few at a time: in a small batch a one-token draft at rate 2/3 always pays a row
    engine = steady_drafts(new_engine(model_dir, speculate="auto", max_running_requests=4))
    warm = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request(prompt, warm)  # the prompt into the tree: the rest leave one token
    while engine.has_unfinished():
        engine.step()
    samples = []
    for seed in range(NUM_REQUESTS):
        params = SamplingParams(temperature=TEMPERATURE, max_tokens=2, seed=seed, ignore_eos=True)
        samples += engine.requests(engine.add_request(prompt, params))
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)
    assert engine.speculator.drafted["prompt"] == NUM_REQUESTS  # every first step drafted d
    firsts = Counter(r.output_ids[0] for r in samples)
    chi_square_below_quantile(firsts, p1, NUM_REQUESTS)
    kept = [r for r in samples if r.output_ids[0] == draft]
    assert engine.speculator.accepted["prompt"] == len(kept)
    sigma = math.sqrt(NUM_REQUESTS * p1[draft] * (1 - p1[draft]))
    assert abs(len(kept) - NUM_REQUESTS * p1[draft]) < 4 * sigma
    seconds = Counter(r.output_ids[1] for r in kept)
    chi_square_below_quantile(seconds, p2, len(kept))
