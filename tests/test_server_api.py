"""The OpenAI-compatible API, driven by the official `openai` client against a live server.

A tiny random model speaks gibberish, so the tests check the contract, not the prose: greedy
runs agree with each other (streamed or not), a seed reproduces, `stop` cuts where the string
first appears, the prefix cache reports hits (and none across salts), and the accounting is back
at idle after each test.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from live_server import LiveServer

pytestmark = pytest.mark.timeout(120)


def _unique(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]} "


def test_models_health_metrics(server: LiveServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert server.get("/health").json() == {"status": "ok"}
    client.completions.create(model="tiny", prompt=_unique(), max_tokens=4)
    metrics = server.get("/metrics").text
    for name in (
        "radixlm_requests_total",
        "radixlm_prompt_tokens_total",
        "radixlm_generation_tokens_total",
        "radixlm_prefix_cache_queried_tokens_total",
        "radixlm_prefix_cache_hit_tokens_total",
        "radixlm_prefix_cache_hit_rate",
        "radixlm_num_requests_running",
        "radixlm_num_requests_waiting",
        "radixlm_kv_slots_used",
        "radixlm_time_to_first_token_seconds_bucket",
        "radixlm_inter_token_latency_seconds_bucket",
    ):
        assert name in metrics, name
    assert 'radixlm_requests_total{route="/v1/completions",status="200"}' in metrics


def test_chat_and_completion_greedy_streamed_or_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": _unique("hi ")}]
    full = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    assert full.object == "chat.completion" and len(full.choices) == 1
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.completion_tokens <= 12
    assert full.usage.prompt_tokens_details is not None
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    prompt = _unique("Once upon ")
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert done.object == "text_completion"
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text


def test_token_id_prompts_and_batches(client: openai.OpenAI) -> None:
    ids = list(_unique("abc").encode())  # the byte-level tokenizer: byte b is token b
    one = client.completions.create(
        model="tiny", prompt=ids, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert one.usage is not None and one.usage.prompt_tokens == len(ids)
    assert one.usage.completion_tokens == 6
    choice = one.choices[0].model_dump()
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 6
    batch = client.completions.create(
        model="tiny", prompt=[ids, "plain text"], max_tokens=3, temperature=0, n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    # Token ids, not text: 3 tokens of random bytes may end inside a UTF-8 character.
    by_index = {c.index: c.model_dump()["token_ids"] for c in batch.choices}
    assert by_index[0] == by_index[1] == choice["token_ids"][:3]


def test_n_stop_and_seed(client: openai.OpenAI) -> None:
    prompt = _unique("Tell me ")
    two = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=7
    )
    assert [c.index for c in two.choices] == [0, 1]
    again = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, n=2, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in two.choices]

    base = (
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    # a stop string of real characters (random bytes may decode to U+FFFD)
    stop = next(
        base[i : i + 2]
        for i in range(4, len(base) - 2)
        if base[i : i + 2].strip() and "\ufffd" not in base[i : i + 2]
    )
    cut = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].text == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_cached_tokens_and_salts(client: openai.OpenAI) -> None:
    system = _unique("You are a helpful assistant. ") * 4
    first = [{"role": "system", "content": system}, {"role": "user", "content": "one"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "two"}]
    a = client.chat.completions.create(model="tiny", messages=first, max_tokens=2)  # type: ignore[arg-type]
    b = client.chat.completions.create(model="tiny", messages=second, max_tokens=2)  # type: ignore[arg-type]
    assert a.usage is not None and b.usage is not None
    assert a.usage.prompt_tokens_details is not None and b.usage.prompt_tokens_details is not None
    # The template's opening ("<|im_start|>system\n") is shared by every chat request before.
    assert a.usage.prompt_tokens_details.cached_tokens < 20
    assert b.usage.prompt_tokens_details.cached_tokens >= len(system)

    prompt = _unique("salted ") * 3
    x = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": "tenant-a"}
    )
    y = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": "tenant-b"}
    )
    z = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": "tenant-a"}
    )
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (x, y, z)]  # type: ignore[union-attr]
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": _unique()}], max_tokens=4,
        logprobs=True, top_logprobs=3, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely
    comp = client.completions.create(
        model="tiny", prompt=_unique(), max_tokens=4, logprobs=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_default_max_tokens_fills_the_context(server: LiveServer) -> None:
    limit = server.engine.engine.runner.max_context_len
    prompt = list(b"x" * (limit - 5))
    response = server.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


def test_api_key_is_required(server: LiveServer) -> None:
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(server.url + "/v1/cache", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    wrong_client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with wrong_client, pytest.raises(openai.AuthenticationError):
        wrong_client.models.list()
    assert server.get("/health").status_code == 200  # health needs no key


def test_cache_routes(server: LiveServer, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt=_unique() * 4, max_tokens=2)
    before = server.wait_idle()
    assert before["num_tree_tokens"] > 0
    assert (
        before["num_free"] + before["num_tree_tokens"] + before["num_in_flight"]
        == before["capacity"]
    )
    flushed = server.post("/v1/cache/flush").json()
    assert flushed["flushed_tokens"] == before["num_tree_tokens"]
    assert flushed["cache"]["num_tree_tokens"] == 0
