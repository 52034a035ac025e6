"""What one server needs for tool conversations and structured outputs, in one object.

    agents = ChatAgents(tokenizer, vocab_size)        # per server
    plan = agents.plan(tools, tool_choice, parallel, response_format)   # ValueError -> 400
    ids = agents.prompt_ids(messages, plan.tools, namespace)            # remembered turns spliced
    ... generate under plan.constraint ...
    agents.remember(namespace, text, token_ids, content, calls)         # for the next turn

Planning and rendering block (grammar compilation, template rendering): call them off the event
loop. Everything here is thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixlm.agents.grammar import JSON_OBJECT, Constraint, GrammarCompiler, TextFormat
from radixlm.agents.prompt import PromptRenderer
from radixlm.agents.tool_parser import ParseDelta, ToolCall, ToolCallParser, parse_tool_calls
from radixlm.agents.tools import ToolChoice, ToolSpec, parse_tool_choice, parse_tools
from radixlm.agents.turns import Turn, TurnMemo, turn_ids
from radixlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatPlan:
    """How one chat request uses tools and grammars."""

    tools: list[ToolSpec]  # sorted by name
    choice: ToolChoice
    constraint: Constraint | None  # the grammar every sample follows, if any

    @property
    def parse_calls(self) -> bool:
        """Outputs are scanned for tool calls (tools were given and may be called)."""
        return bool(self.tools) and self.choice.mode != "none"


class ChatAgents:
    """The prompt renderer with its turn memo, and the grammar compiler (built on first use:
    llguidance's token trie takes about a second for a 49k vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, memo_capacity: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.memo = TurnMemo(memo_capacity)
        self.renderer = PromptRenderer(tokenizer, self.memo)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._compiler

    def plan(
        self,
        tools: object,
        tool_choice: object,
        parallel_tool_calls: bool | None,
        response_format: Mapping[str, Any] | None,
    ) -> ChatPlan:
        """Validate tools and compile the request's grammar (`GrammarCompiler.tool_calls`). Raises
        ValueError naming the problem: a malformed tool or schema, a named tool not in tools,
        a schema that cannot compile or accepts nothing."""
        specs = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, specs)
        if specs:
            self.compiler.check_tools(specs)
        parallel = True if parallel_tool_calls is None else parallel_tool_calls
        text_format = _text_format(response_format)
        if not specs and text_format is None:
            return ChatPlan(specs, choice, None)
        constraint = self.compiler.tool_calls(specs, choice, parallel, text_format)
        return ChatPlan(specs, choice, constraint)

    def prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSpec],
        namespace: str | None,
    ) -> list[int]:
        return self.renderer.prompt_ids(messages, tools, namespace)

    def remember(
        self,
        namespace: str | None,
        text: str,
        token_ids: Sequence[int],
        content: str | None,
        calls: Sequence[ToolCall],
    ) -> Turn | None:
        """Record the ids behind a returned assistant message, when they are exactly what the
        client saw (`turns.turn_ids`); the turn, or None when nothing was recorded."""
        ids = turn_ids(self.tokenizer, text, token_ids)
        if ids is None:
            return None
        turn = Turn(content, tuple((c.name, c.arguments) for c in calls), ids)
        self.memo.remember(namespace, turn.content, turn.calls, turn.ids)
        return turn


def _text_format(response_format: Mapping[str, Any] | None) -> TextFormat | None:
    """A chat request's response_format as a grammar's text format (None: free text)."""
    kind = None if response_format is None else response_format.get("type")
    if response_format is None or kind not in ("json_object", "json_schema"):
        return None
    if kind == "json_object":
        return JSON_OBJECT
    spec = response_format.get("json_schema") or {}
    name = f"json_schema {spec.get('name', '')!r}"
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise ValueError(f"{name}: response_format.json_schema.schema must be an object")
    return TextFormat(schema, bool(spec.get("strict")), name)


@dataclass
class _Choice:
    parser: ToolCallParser
    text: list[str]
    token_ids: list[int]
    content: list[str]


class Reply(NamedTuple):
    """One finished output as an assistant message."""

    content: str | None  # None when the output was calls only
    calls: list[ToolCall]
    turn: Turn | None  # what was remembered for the next turn (None: ids the client never saw)


class ChatOutputs:
    """One chat request's outputs as OpenAI messages: tool calls parsed out when the request
    has tools, and every finished choice remembered for the next turn.

    Non-streaming: `message(text, token_ids, finish_reason)` per choice. Streaming:
    `delta(index, text, ids)` per engine delta and `finish(index, finish_reason)` at its end,
    which decides what the parser held back (an unclosed call of a cut output is text).
    """

    def __init__(self, agents: ChatAgents, plan: ChatPlan, namespace: str | None) -> None:
        self.agents = agents
        self.plan = plan
        self.namespace = namespace
        self._choices: dict[int, _Choice] = {}

    def message(self, text: str, token_ids: Sequence[int], reason: str | None = "stop") -> Reply:
        """A whole output as a message; remembers it."""
        if self.plan.parse_calls:
            parsed = parse_tool_calls(text, cut=reason == "length")
            content, calls = parsed.content, parsed.tool_calls
        else:
            content, calls = text, []
        turn = self.agents.remember(self.namespace, text, token_ids, content, calls)
        return Reply(content, calls, turn)

    def delta(self, index: int, text: str, token_ids: Sequence[int]) -> ParseDelta:
        """What a streamed increment adds to choice `index`: content and whole calls."""
        choice = self._choice(index)
        choice.text.append(text)
        choice.token_ids.extend(token_ids)
        out = choice.parser.feed(text) if self.plan.parse_calls else ParseDelta(text)
        choice.content.append(out.content)
        return out

    def finish(self, index: int, reason: str | None = "stop") -> tuple[ParseDelta, Reply]:
        """The held-back rest of choice `index`, and the message it makes; remembers it."""
        choice = self._choice(index)
        cut = reason == "length"
        out = choice.parser.finish(cut) if self.plan.parse_calls else ParseDelta()
        choice.content.append(out.content)
        calls = choice.parser.calls
        joined = "".join(choice.content)
        content = joined if joined or not calls else None
        turn = self.agents.remember(
            self.namespace, "".join(choice.text), choice.token_ids, content, calls
        )
        return out, Reply(content, calls, turn)

    def _choice(self, index: int) -> _Choice:
        if index not in self._choices:
            self._choices[index] = _Choice(ToolCallParser(), [], [], [])
        return self._choices[index]


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when an output that stopped by itself made calls;
    an output cut by max_tokens is "length", calls or not."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def call_deltas(delta: ParseDelta) -> list[dict[str, Any]]:
    """A parse delta's calls as OpenAI stream deltas, each whole: index, id, type, function."""
    return [
        {"index": c.index, "id": c.id, "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in delta.calls
    ]  # fmt: skip
