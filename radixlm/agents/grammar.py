"""Constrained decoding with llguidance: grammars for structured outputs and tool calls, one
matcher per sample, and the token masks the sampler applies in its batched call.

    compiler = GrammarCompiler(tokenizer, vocab_size)   # one per model (builds llguidance's
    constraint = compiler.json_schema(schema, strict)   #   token trie once, ~1 s)
    matcher = constraint.new_matcher()                   # per sample; fork() for n > 1
    scores, failed = apply_token_masks(logits, [matcher, None, ...])   # (R, V), batched
    matcher.advance(token)                               # after each sampled token

A grammar the library cannot compile raises ValueError naming the problem (a 400 for the server),
never an unconstrained answer. JSON is compact and deterministic (", " and ": ", no free
whitespace): a small model given free whitespace can spend its whole budget on newlines, and fixed
bytes keep the cached prefix of a resent turn stable.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import llguidance
import llguidance.hf
import numpy as np
import torch

from radixlm.agents.chat_format import CALL_SEPARATOR, CALL_SUFFIX, call_prefix
from radixlm.agents.schemas import check_ref_loops, closed_schema
from radixlm.agents.tools import ToolChoice, ToolSpec
from radixlm.tokenizer import Tokenizer

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHED_GRAMMARS = 64  # agents resend the same tools every step: compile them once


class TextFormat(NamedTuple):
    """A response format as a grammar takes it: JSON under `schema`."""

    schema: Mapping[str, Any]
    strict: bool
    name: str  # for messages: "json_schema 'weather'"


JSON_OBJECT = TextFormat({"type": "object"}, strict=False, name="json_object")


class GrammarError(RuntimeError):
    """A matcher rejected a token or has no token left to allow (fails that request only)."""


class GrammarMatcher:
    """One sample's position in its grammar. Not thread-safe; owned by one request."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (an n > 1 sample starts from the leader's)."""
        return GrammarMatcher(self._matcher.deep_copy())

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into `row`, a contiguous int32 CPU tensor."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def advance(self, token_id: int) -> None:
        """Consume a sampled token. Raises GrammarError when the grammar rejects it."""
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"the output left its grammar: {self.error}")

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    @property
    def failed(self) -> bool:
        """The matcher is in an error state (it stays there)."""
        return self._matcher.is_error()

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: only an end-of-sequence token is allowed."""
        return self._matcher.is_stopped()


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar; `new_matcher` gives each sample its own state."""

    description: str  # what it constrains, for messages ("json_schema 'weather'")
    grammar: str  # llguidance's grammar text
    prototype: llguidance.LLMatcher  # at the start state; only ever copied
    first_tokens: np.ndarray  # (K,) int64: the ids the grammar allows first, ascending

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.prototype.deep_copy())

    def check_first_token(self, banned: frozenset[int]) -> None:
        """ValueError when every token the grammar allows first is in `banned` (what min_tokens
        holds back: end-of-sequence and stop ids), so no first token could be sampled."""
        if banned and bool(np.isin(self.first_tokens, list(banned)).all()):
            raise ValueError(
                f"{self.description} must start with an end-of-sequence or stop token, which "
                "min_tokens bans: no output could begin; lower min_tokens or change "
                "stop_token_ids"
            )


class GrammarCompiler:
    """Compiles response formats and tool choices for one tokenizer and logits width."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer.hf_tokenizer,  # type: ignore[arg-type]  # a fast tokenizer (checked there)
            n_vocab=vocab_size,  # the logits' width; ids past the tokenizer are never allowed
            eos_token=sorted(tokenizer.eos_token_ids) or None,
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, Constraint] = OrderedDict()
        self._lock = threading.Lock()

    def json_object(self) -> Constraint:
        return self.json_schema(JSON_OBJECT.schema, strict=False, name=JSON_OBJECT.name)

    def json_schema(
        self, schema: Mapping[str, Any], strict: bool, name: str = "json_schema"
    ) -> Constraint:
        """Any JSON the schema accepts, its objects closed (`closed_schema`). strict: unsupported
        keywords are errors (OpenAI's strict guarantees the schema); otherwise they are ignored,
        a best-effort constraint."""
        check_ref_loops(schema, name)
        options = {**JSON_STYLE, "lenient": not strict}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                closed_schema(schema),
                overrides=options,  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return self.compile(grammar, name)

    def tool_calls(
        self,
        tools: Sequence[ToolSpec],
        choice: ToolChoice,
        parallel: bool,
        text_format: TextFormat | None = None,
    ) -> Constraint | None:
        """The grammar of a chat output, or None when it is unconstrained.

        The output is text (free, or `text_format`'s JSON) or calls in the built-in format:

            none      text; with tools given, text that never opens a call
            auto      text or calls; unconstrained unless a tool is strict, the choice narrows
                      the tools (allowed_tools) or a text format is asked for
            required  one call (or several with `parallel`) to a tool the choice allows
            named     calls to that tool

        Every call's arguments follow its tool's schema closed (`closed_schema`): only the
        declared properties, each once, in their order.
        """
        if choice.mode == "none" or not tools:
            if text_format is not None:
                return self.json_schema(text_format.schema, text_format.strict, text_format.name)
            return self._lark(["start: TEXT?"], "tools (none)") if tools else None
        narrowed = choice.allowed is not None and len(choice.allowed) < len(tools)
        strict = any(t.strict for t in tools)
        if choice.mode == "auto" and text_format is None and not narrowed and not strict:
            return None
        chosen = choice.callable(tools)
        calls = "call (" + json.dumps(CALL_SEPARATOR) + " call)*" if parallel else "call"
        lines = [
            "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))),
            *(f"call_{i}: {_call_rule(t)}" for i, t in enumerate(chosen)),
        ]
        if choice.mode != "auto":
            lines.insert(0, f"start: {calls}")
        elif text_format is None:
            lines.insert(0, f"start: TEXT | {calls}")
        else:  # the text branch is the response format's JSON
            lines += [f"start: format | {calls}", f"format: {self._format_rule(text_format)}"]
        return self._lark(lines, f"tools ({choice.mode})")

    def check_tools(self, tools: Sequence[ToolSpec]) -> None:
        """Compile every tool's parameters schema alone, so a malformed one is a 400 naming its
        tool even when no grammar would use it."""
        for tool in tools:
            self.json_schema(tool.parameters, tool.strict, f"tool {tool.name!r} parameters")

    def _format_rule(self, text_format: TextFormat) -> str:
        check_ref_loops(text_format.schema, text_format.name)
        schema = {**closed_schema(text_format.schema), "x-guidance": _style(not text_format.strict)}
        return "%json " + json.dumps(schema)

    def _lark(self, lines: list[str], description: str) -> Constraint:
        # free text: anything that does not open a call
        lark = "\n".join([*lines, r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"])
        return self.compile(llguidance.LLMatcher.grammar_from_lark(lark), description)

    def compile(self, grammar: str, description: str) -> Constraint:
        """Validate and build `grammar` (cached). Raises ValueError with llguidance's reason."""
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"{description} cannot be compiled: {error.strip()}")
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        first = _first_tokens(matcher, self.vocab_size)
        if matcher.is_error():
            raise ValueError(f"{description} cannot be compiled: {matcher.get_error().strip()}")
        if len(first) == 0:  # e.g. a $ref that resolves to itself: no document matches it
            raise ValueError(f"{description} cannot be compiled: it accepts no output at all")
        constraint = Constraint(description, grammar, matcher, first)
        with self._lock:
            self._cache[grammar] = constraint
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return constraint


class MaskedScores(NamedTuple):
    scores: torch.Tensor  # (R, V): logits with disallowed tokens at -inf (the input if no mask)
    failed: list[int]  # rows whose grammar is in error or allows no token at all


def apply_token_masks(
    logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]
) -> MaskedScores:
    """Mask every constrained row of `logits` (R, V) in one batched op; never modifies the input.

    Bitmasks are computed on the host (llguidance, microseconds per row) and unpacked into one
    (R, V) "disallowed" boolean (unconstrained rows all False), applied by one masked_fill.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return MaskedScores(logits, [])
    num_rows, vocab = logits.shape
    words = (vocab + 31) // 32
    bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)  # (R, W): all allowed
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_mask(bitmask[i])
    failed = [i for i in rows if matchers[i].failed or not bool(bitmask[i].any())]  # type: ignore[union-attr]
    # bit b of word w is token 32 w + b: little-endian bytes, least significant bit first
    disallowed = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    disallowed_t = torch.from_numpy(disallowed[:, :vocab].view(np.bool_))  # (R, V)
    scores = logits.masked_fill(disallowed_t.to(logits.device), float("-inf"))
    return MaskedScores(scores, failed)


def _first_tokens(prototype: llguidance.LLMatcher, vocab_size: int) -> np.ndarray:
    """The ids a matcher at its start state allows (computed on a copy: the prototype stays
    untouched); empty when the grammar cannot start."""
    matcher = prototype.deep_copy()
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    if matcher.is_error():  # some grammars fail only once a mask is asked for
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(mask, bitorder="little")  # bit b of byte k: token 8 k + b
    return np.flatnonzero(bits[:vocab_size]).astype(np.int64)


def _call_rule(tool: ToolSpec) -> str:
    """One tool's call in the built-in format, its arguments under the tool's closed schema."""
    schema = {**closed_schema(tool.parameters), "x-guidance": _style(not tool.strict)}
    return " ".join(
        [json.dumps(call_prefix(tool.name)), "%json " + json.dumps(schema), json.dumps(CALL_SUFFIX)]
    )


def _style(lenient: bool) -> dict[str, Any]:
    return {**JSON_STYLE, "lenient": lenient}
