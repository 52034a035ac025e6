"""The offline API: prompts as text, token ids or chat messages; outputs in prompt order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import save_tiny_model

from radixlm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = tmp_path_factory.mktemp("llm-model")
    save_tiny_model("qwen2-gqa-tied", path, max_position_embeddings=512)
    return LLM(str(path), dtype="float32", num_slots=2048, num_threads=1)


def test_text_ids_and_chat_prompts(llm: LLM) -> None:
    chat = [{"role": "user", "content": "hi"}]
    prompts: list[str | list[int] | list[dict[str, Any]]] = ["hello there", [72, 105, 33], chat]
    text, ids, messages = llm.generate(prompts, GREEDY)
    assert text.prompt_token_ids == llm.tokenizer.encode("hello there")
    assert ids.prompt_token_ids == [72, 105, 33]
    hf = llm.tokenizer.hf_tokenizer
    rendered = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)
    assert messages.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    for out in (text, ids, messages):
        assert len(out.token_ids) == 8
        assert out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.metrics is not None
        assert 0 <= out.metrics.queue_s <= out.metrics.ttft_s <= out.metrics.total_s


def test_a_single_prompt_and_per_prompt_params(llm: LLM) -> None:
    [one] = llm.generate([1, 2, 3], GREEDY)
    assert one.prompt_token_ids == [1, 2, 3]
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    a, b = llm.generate(["x", "y"], [GREEDY, short])
    assert (len(a.token_ids), len(b.token_ids)) == (8, 2)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(["x", "y"], [GREEDY])


def test_second_request_hits_the_cache_within_its_salt_only(llm: LLM) -> None:
    prompt = list(range(30, 90))
    first = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    same = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    other = llm.generate(prompt, GREEDY, cache_salt="tenant-b")[0]
    assert first.cached_tokens == 0
    assert same.cached_tokens == len(prompt) - 1
    assert other.cached_tokens == 0
    assert same.token_ids == first.token_ids == other.token_ids


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = llm.generate([5, 6, 7], params)[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for lp, token in zip(lps, out.token_ids):
        assert lp.token_id == token
        assert len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1])


def test_bad_prompts_raise(llm: LLM) -> None:
    with pytest.raises(ValueError, match="a prompt is"):
        llm.generate([[1.5, 2.5]], GREEDY)  # type: ignore[arg-type]  # the bad value under test
    with pytest.raises(ValueError, match="role"):
        llm.generate([[{"role": "wizard", "content": "x"}]], GREEDY)
