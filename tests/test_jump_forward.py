"""Jump-forward: the tokens a grammar forces are drafted and verified in one step, and the
output is token for token what decoding them one at a time gives.

The forced tokens (llguidance's fast-forward tokens: JSON keys, punctuation, a tool call's
fixed text) go through the verify rows like any draft, each row sampled under the grammar's mask
after the tokens before it, so a constrained output cannot differ from the one-token-a-step
output; with most of a schema's bytes forced, it takes far fewer decode steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_helpers import assert_idle, new_engine, steady_drafts
from helpers import save_tiny_model

from radixlm.agents.grammar import GrammarCompiler
from radixlm.api_types import SamplingParams
from radixlm.engine.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("jump-forward")
    save_tiny_model("llama-gqa-llama3rope", path, vocab_size=272, max_position_embeddings=1024)
    return path


def constrained(engine: Engine, prompts: list[list[int]], temperature: float) -> list[list[int]]:
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size)
    params = SamplingParams(
        temperature=temperature, max_tokens=80, seed=3,
        constraint=compiler.json_schema(SCHEMA, strict=True),
    )  # fmt: skip
    ids = [engine.add_request(p, params) for p in prompts]
    samples = [engine.requests(rid)[0] for rid in ids]
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)
    assert all(r.finish_reason == "stop" for r in samples)
    return [r.output_ids for r in samples]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_forced_tokens_take_one_step_and_change_no_token(
    model_dir: Path, temperature: float
) -> None:
    off = new_engine(model_dir, speculate="off")
    on = steady_drafts(new_engine(model_dir, speculate="auto"))
    prompts = [off.tokenizer.encode(t) for t in ("Weather for Paris, 3 days: ", "Oslo? ")]
    expected = constrained(off, prompts, temperature)
    assert constrained(on, prompts, temperature) == expected
    for ids in expected:
        value = json.loads(off.tokenizer.decode(ids[:-1]))  # the last token is the eos
        assert set(value) == {"city", "days", "unit"}
    grammar = on.speculator.stats()["grammar"]
    assert grammar["drafted"] > 0 and grammar["accepted"] > 0
    # most of the output is forced: far fewer decode steps than tokens
    assert on.stats.decode_tokens * 2 < off.stats.decode_tokens


def test_forced_tokens_count_as_drafted_and_accepted_in_the_request(model_dir: Path) -> None:
    engine = steady_drafts(new_engine(model_dir, speculate="auto"))
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            constraint=compiler.json_schema(SCHEMA, strict=True))  # fmt: skip
    rid = engine.add_request(engine.tokenizer.encode("Lima: "), params)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    last = deltas[-1]
    assert last.finish_reason == "stop"
    assert last.drafted_tokens is not None and last.accepted_tokens > 0
    assert last.accepted_tokens <= last.drafted_tokens
    assert sum(len(d.token_ids) for d in deltas) == last.completion_tokens
    assert any(len(d.token_ids) > 1 for d in deltas)  # several tokens in one step's delta
    assert rid == last.request_id
