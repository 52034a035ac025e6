"""llguidance grammars: what each response format and tool choice accepts, per-sample matchers,
batched masks, and the errors a client gets for schemas that cannot compile."""

from __future__ import annotations

import json

import pytest
import torch
from agent_helpers import ADD, WEATHER, random_constrained
from tiny_tokenizers import byte_level

from radixlm.agents.grammar import Constraint, GrammarCompiler, GrammarError, apply_token_masks
from radixlm.agents.tool_parser import parse_tool_calls
from radixlm.agents.tools import ToolChoice, parse_tool_choice, parse_tools

VOCAB = 330  # wider than the tokenizer (320), as a model's padded logits are


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(byte_level(), VOCAB)


def _text(ids: list[int]) -> str:
    return byte_level().decode(ids)


def _accepts(compiler: GrammarCompiler, constraint_text: str, constraint: Constraint) -> bool:
    matcher = constraint.new_matcher()
    ids = byte_level().encode(constraint_text, add_special_tokens=False)
    try:
        for t in ids:
            matcher.advance(t)
    except GrammarError:
        return False
    return True


def test_json_schema_output_parses_and_validates(compiler: GrammarCompiler) -> None:
    schema = ADD["function"]["parameters"]
    constraint = compiler.json_schema(schema, strict=True)
    eos = byte_level().eos_token_ids
    for seed in range(5):
        ids = random_constrained(constraint.new_matcher(), VOCAB, eos, seed)
        value = json.loads(_text(ids[:-1]))
        assert set(value) == {"a", "b"} and all(0 <= value[k] <= 99 for k in "ab")
    assert _accepts(compiler, '{"a": 1, "b": 2}', constraint)
    assert not _accepts(compiler, '{"a": 1}x', constraint)
    assert not _accepts(compiler, '{ "a":1', constraint)  # compact, fixed separators


def test_json_object_accepts_objects_only(compiler: GrammarCompiler) -> None:
    constraint = compiler.json_object()
    assert _accepts(compiler, '{"k": [1, "two", null]}', constraint)
    assert not _accepts(compiler, "[1]", constraint)
    assert not _accepts(compiler, "hello", constraint)


@pytest.mark.parametrize(
    ("schema", "strict", "reason"),
    [
        ({"type": "objectx"}, False, "Invalid type: objectx"),
        ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, True, "/defs/x"),
        ({"type": "string", "format": "no-such-format"}, True, "Unknown format"),
    ],
)
def test_uncompilable_schema_is_a_value_error_naming_why(
    compiler: GrammarCompiler, schema: dict[str, object], strict: bool, reason: str
) -> None:
    with pytest.raises(ValueError, match="cannot be compiled") as info:
        compiler.json_schema(schema, strict=strict, name="json_schema 'x'")
    assert reason in str(info.value) and "json_schema 'x'" in str(info.value)


def test_lenient_when_not_strict(compiler: GrammarCompiler) -> None:
    compiler.json_schema({"type": "string", "format": "no-such-format"}, strict=False)


def test_check_tools_names_the_tool(compiler: GrammarCompiler) -> None:
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}  # fmt: skip
    with pytest.raises(ValueError, match="tool 'broken' parameters"):
        compiler.check_tools(parse_tools([WEATHER, bad]))
    compiler.check_tools(parse_tools([WEATHER, ADD]))


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_forces_a_parseable_call(compiler: GrammarCompiler, seed: int) -> None:
    tools = parse_tools([WEATHER, ADD])
    constraint = compiler.tool_calls(tools, ToolChoice("required"), parallel=False)
    assert constraint is not None
    ids = random_constrained(constraint.new_matcher(), VOCAB, byte_level().eos_token_ids, seed)
    parsed = parse_tool_calls(_text(ids[:-1]))
    assert parsed.content is None and len(parsed.tool_calls) == 1
    call = parsed.tool_calls[0]
    assert call.name in ("get_weather", "add")
    assert isinstance(json.loads(call.arguments), dict)


def test_named_choice_and_parallel_calls(compiler: GrammarCompiler) -> None:
    tools = parse_tools([WEATHER, ADD])
    named = compiler.tool_calls(tools, parse_tool_choice(
        {"type": "function", "function": {"name": "add"}}, tools), parallel=True)  # fmt: skip
    assert named is not None
    eos = byte_level().eos_token_ids
    names: set[str] = set()
    for seed in range(6):
        ids = random_constrained(named.new_matcher(), VOCAB, eos, seed)
        calls = parse_tool_calls(_text(ids[:-1])).tool_calls
        names.update(c.name for c in calls)
    assert names == {"add"}
    two = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert _accepts(compiler, two + "\n" + two, named)
    single = compiler.tool_calls(tools, ToolChoice("required"), parallel=False)
    assert single is not None and not _accepts(compiler, two + "\n" + two, single)


def test_auto_is_free_unless_a_tool_is_strict(compiler: GrammarCompiler) -> None:
    assert compiler.tool_calls(parse_tools([ADD]), ToolChoice("auto"), parallel=True) is None
    assert compiler.tool_calls([], ToolChoice("none"), parallel=True) is None
    none = compiler.tool_calls(parse_tools([ADD]), ToolChoice("none"), parallel=True)
    assert none is not None  # tools given, none allowed: free text that never opens a call
    assert _accepts(compiler, "Just text, no call.", none)
    assert not _accepts(compiler, "Sure: <tool_call>", none)
    strict = compiler.tool_calls(parse_tools([WEATHER]), ToolChoice("auto"), parallel=True)
    assert strict is not None
    assert _accepts(compiler, "Just text, no call.", strict)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _accepts(compiler, good, strict)
    assert not _accepts(compiler, good.replace("Oslo", "Rome"), strict)


def test_masks_are_batched_per_row_and_leave_the_input_alone(compiler: GrammarCompiler) -> None:
    constraint = compiler.json_object()
    a, b = constraint.new_matcher(), constraint.new_matcher()
    brace = byte_level().encode("{", add_special_tokens=False)[0]
    b.advance(brace)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    masked = apply_token_masks(logits, [a, None, b])
    assert torch.equal(logits, before) and masked.failed == []
    assert torch.equal(masked.scores[1], logits[1])  # the unconstrained row is untouched
    first = torch.isfinite(masked.scores[0]).nonzero().flatten().tolist()
    assert all(_text([t]).lstrip().startswith("{") for t in first)
    assert not torch.isfinite(masked.scores[0, 320:]).any()  # past the tokenizer: never
    assert torch.isfinite(masked.scores[2]).sum() > 0
    assert brace not in torch.isfinite(masked.scores[2]).nonzero().flatten().tolist()


def test_forks_are_independent(compiler: GrammarCompiler) -> None:
    leader = compiler.json_object().new_matcher()
    leader.advance(byte_level().encode("{", add_special_tokens=False)[0])
    fork = leader.fork()
    quote = byte_level().encode('"', add_special_tokens=False)[0]
    close = byte_level().encode("}", add_special_tokens=False)[0]
    leader.advance(close)
    assert leader.is_finished and not fork.is_finished
    fork.advance(quote)
    with pytest.raises(GrammarError):
        leader.advance(quote)
    assert apply_token_masks(torch.zeros(1, VOCAB), [leader]).failed == [0]


def test_the_sampler_masks_biases_and_isolates_a_failing_grammar(
    compiler: GrammarCompiler,
) -> None:
    from radixlm.api_types import SamplingParams
    from radixlm.engine.sampler import SampledToken, Sampler, SamplingFailure, SamplingState

    brace = byte_level().encode("{", add_special_tokens=False)[0]
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 5.0  # every row's free greedy choice
    constraint = compiler.json_object()
    dead = SamplingState(SamplingParams(temperature=0.0, constraint=constraint))
    dead.advance(brace)
    dead.advance(byte_level().encode("}", add_special_tokens=False)[0])
    assert dead.matcher is not None
    dead.matcher._matcher.consume_token(brace)  # now in error
    states = [
        SamplingState(SamplingParams(temperature=0.0, constraint=constraint)),
        SamplingState(SamplingParams(temperature=0.0, logit_bias=((9, 100.0),))),
        SamplingState(SamplingParams(temperature=0.0, min_tokens=2), stop_ids=frozenset({7})),
        dead,
    ]
    outcomes = Sampler().sample_each(logits, states)
    assert isinstance(outcomes[0], SampledToken)
    assert _text([outcomes[0].token_id]).lstrip().startswith("{")  # the grammar's choice
    assert outcomes[1] == SampledToken(9, None)  # the bias wins over the model
    assert isinstance(outcomes[2], SampledToken) and outcomes[2].token_id != 7  # banned
    assert isinstance(outcomes[3], SamplingFailure)  # fails alone
    assert "grammar" in str(outcomes[3].error)
