"""Chat messages to prompt token ids: the one renderer. The server (chat completions and the
Responses API), the offline `LLM`, `radixlm chat` and `radixlm generate` all go through
`PromptRenderer`, so one conversation is one list of ids wherever it comes from.

It validates the messages (`chat_format.check_messages`), applies the chat template (tools in
canonical order), splices remembered assistant turns in as the ids the model generated, and
guards against forged special tokens:

    rendered text:  [segment 0] <turn 1> [segment 1] <turn 2> [segment 2]
    prompt ids:     encode(seg 0) + ids(turn 1) + encode(seg 1) + ids(turn 2) + encode(seg 2)

Segment 0 is the text of the step-1 prompt and is encoded by the same function, so step 2's ids
start with step 1's prompt + output: the cache match ends where the new messages begin.

Message content is text, never control: where content spells a special token (a user typing
`<|im_start|>system` to forge a turn), that content is encoded without special-token parsing,
the way vLLM and llama.cpp do; the template's own text is encoded with it. Contents are found in
the rendered text by `Marks`. A chat whose content spells no special token gets exactly the ids
of encoding its rendered text.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from radixlm.agents.chat_format import (
    check_messages,
    template_renders_tools,
    template_tools,
    to_template_messages,
)
from radixlm.agents.tools import ToolSpec, canonical_json
from radixlm.agents.turns import Turn, TurnMemo, turn_key
from radixlm.tokenizer import Tokenizer

FORGED = (
    "message content contains special-token text (such as a chat template's role markers), "
    "which this model's chat template does not let the server encode as plain text"
)


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template, so chat messages cannot be turned into a prompt."""


class Prompt(NamedTuple):
    ids: list[int]
    turns: tuple[Turn, ...]  # the assistant turns spliced in as generated ids, in order


class Span(NamedTuple):
    label: str  # what the marks were labelled with (a message number, or "")
    start: int  # character offsets in the unmarked text, [start, end)
    end: int


@dataclass(frozen=True)
class Marks:
    """Unguessable markers around message contents in a rendering (private-use characters around
    a fresh nonce), so that where each content lies in the rendered text is known. Only a
    content's core is marked: its edge whitespace stays outside, where a template's trim finds
    it."""

    nonce: str = field(default_factory=lambda: secrets.token_hex(8))

    def wrap(self, content: str, label: str = "") -> str:
        core = content.strip()
        if not core:
            return content
        lead = content[: len(content) - len(content.lstrip())]
        trail = content[len(content.rstrip()) :]
        return f"{lead}\ue000{self.nonce}{label}\ue001{core}\ue002{self.nonce}\ue003{trail}"

    def unmark(self, marked: str) -> tuple[str, list[Span] | None]:
        """The text without marks and the spans they delimited; None for the spans when the
        template dropped or doubled a mark (it transforms content: positions are unknown)."""
        spans: list[Span] = []
        out: list[str] = []
        length, pos = 0, 0
        opened: tuple[str, int] | None = None
        balanced = True
        for match in self._pattern.finditer(marked):
            out.append(marked[pos : match.start()])
            length += match.start() - pos
            pos = match.end()
            is_open = match.group(1) is not None
            if is_open != (opened is None):
                balanced = False
            elif opened is None:
                opened = (match.group(1), length)
            else:
                spans.append(Span(opened[0], opened[1], length))
                opened = None
        out.append(marked[pos:])
        return "".join(out), spans if balanced and opened is None else None

    @property
    def _pattern(self) -> re.Pattern[str]:
        nonce = re.escape(self.nonce)
        return re.compile(f"\ue000{nonce}([^\ue001]*)\ue001|\ue002{nonce}\ue003")


class PromptRenderer:
    """Chat messages (+ tools) -> prompt ids, splicing remembered assistant turns when it has a
    memo. Immutable but for the memo (thread-safe): share one per server."""

    def __init__(self, tokenizer: Tokenizer, memo: TurnMemo | None = None) -> None:
        self.tokenizer = tokenizer
        self.memo = memo
        hf = tokenizer.hf_tokenizer
        self.native_tools = template_renders_tools(hf)
        self._backend: Any = getattr(hf, "backend_tokenizer", None)
        self._plain: Any = None  # the same tokenizer with special-token parsing off
        if self._backend is not None:
            from tokenizers import Tokenizer as RustTokenizer

            self._plain = RustTokenizer.from_str(self._backend.to_str())
            self._plain.encode_special_tokens = True

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[ToolSpec] = ()) -> str:
        """The prompt text, ending with the assistant's header (no splicing: for reading)."""
        conversation = to_template_messages(check_messages(messages), tools, self.native_tools)
        return self._template(conversation, tools)

    def prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSpec] = (),
        namespace: str | None = None,
    ) -> list[int]:
        """Token ids of the prompt (see `prompt`)."""
        return self.prompt(messages, tools, namespace).ids

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSpec] = (),
        namespace: str | None = None,
        known: Sequence[Turn] = (),
    ) -> Prompt:
        """The prompt's ids and the turns spliced into them: an assistant message is its ids
        from `known` (a stored conversation's own turns) or else the memo, in `namespace`.
        Raises ValueError for invalid messages (NoChatTemplateError without a template)."""
        checked = check_messages(messages)
        conversation = to_template_messages(checked, tools, self.native_tools)
        if self.native_tools:  # the template writes tools and calls outside any content
            self._refuse_forged(_outside_content(checked, tools))
        turns = self._spliced_turns(checked, namespace, known)
        marks = Marks()
        placeholder = f"\ue004{marks.nonce}"
        marked = []
        num_marked = 0
        assistant = 0
        for m in conversation:
            m = dict(m)
            if m["role"] == "assistant" and assistant in turns:  # known ids: a placeholder
                m["content"] = f"{placeholder}{assistant}{placeholder}"
                m.pop("tool_calls", None)
            else:
                num_marked += bool(m["content"].strip())
                m["content"] = marks.wrap(m["content"])
            assistant += m["role"] == "assistant"
            marked.append(m)
        rendered = self._template(marked, tools)
        pattern = f"{re.escape(placeholder)}(\\d+){re.escape(placeholder)}"
        pieces = re.split(pattern, rendered)
        segments = [marks.unmark(piece) for piece in pieces[::2]]
        found = [spans for _, spans in segments if spans is not None]
        complete = len(found) == len(segments) and sum(map(len, found)) == num_marked
        if len(pieces) != 2 * len(turns) + 1 or not complete:
            # The template transforms content: positions are unknown, so nothing is spliced,
            # and content that would forge a special token is refused.
            self._refuse_forged([m["content"] for m in conversation])
            return Prompt(self._encode(self._template(conversation, tools)), ())
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if j % 2:
                ids += turns[int(piece)].ids
            else:
                text, spans = segments[j // 2]
                ids += self._encode_segment(text, spans or [])
        return Prompt(ids, tuple(turns[i] for i in sorted(turns)))

    # ---- helpers ----------------------------------------------------------------------------
    def _spliced_turns(
        self, checked: list[dict[str, Any]], namespace: str | None, known: Sequence[Turn]
    ) -> dict[int, Turn]:
        """assistant message number -> the turn whose ids render it, where one is known."""
        by_key = {turn.key: turn for turn in known}
        turns: dict[int, Turn] = {}
        assistants = [m for m in checked if m["role"] == "assistant"]
        for i, m in enumerate(assistants):
            calls = tuple((c["name"], c["arguments"]) for c in m.get("tool_calls", ()))
            turn = by_key.get(turn_key(m["content"], calls))
            if turn is None and self.memo is not None:
                ids = self.memo.recall(namespace, m["content"], calls)
                turn = Turn(m["content"], calls, ids) if ids is not None else None
            if turn is not None:
                turns[i] = turn
        return turns

    def _template(self, conversation: list[dict[str, Any]], tools: Sequence[ToolSpec]) -> str:
        hf = self.tokenizer.hf_tokenizer
        if not self.tokenizer.has_chat_template:
            raise NoChatTemplateError(
                "this model's tokenizer has no chat template; send a plain prompt (completions) "
                "or give the model a chat template"
            )
        kwargs: dict[str, Any] = {}
        if self.native_tools and tools:
            kwargs["tools"] = template_tools(tools)
        return str(
            hf.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False, **kwargs
            )
        )

    def _encode_segment(self, text: str, spans: list[Span]) -> list[int]:
        """Ids of one segment of rendered text with its message contents at `spans`: the forgery
        guard. The whole text is encoded at once unless a special token overlaps a content;
        then contents are encoded without special-token parsing, the rest with it."""
        if self._backend is None:  # a slow tokenizer has no offsets: refuse what would forge
            self._refuse_forged([text[s.start : s.end] for s in spans])
            return self._encode(text)
        encoding = self._backend.encode(text, add_special_tokens=False)
        special = self.tokenizer.special_ids
        forged = any(
            token in special and _overlaps(offset, spans)
            for token, offset in zip(encoding.ids, encoding.offsets)
        )
        if not forged:
            return list(encoding.ids)
        ids: list[int] = []
        pos = 0
        for _, a, b in [*spans, Span("", len(text), len(text))]:
            if pos < a:
                ids += self._backend.encode(text[pos:a], add_special_tokens=False).ids
            if a < b:
                ids += self._plain.encode(text[a:b], add_special_tokens=False).ids
            pos = b
        return ids

    def _refuse_forged(self, contents: Sequence[str | None]) -> None:
        special = self.tokenizer.special_ids
        for content in contents:
            if content and any(t in special for t in self._encode(content)):
                raise ValueError(FORGED)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _outside_content(checked: list[dict[str, Any]], tools: Sequence[ToolSpec]) -> list[str]:
    """The client's text a template that renders tools writes outside message contents."""
    calls = [c for m in checked for c in m.get("tool_calls", ())]
    return [canonical_json(t.to_openai()) for t in tools] + [
        f"{c['name']} {c['arguments']}" for c in calls
    ]


def _overlaps(offset: tuple[int, int], spans: list[Span]) -> bool:
    start, end = offset
    return any(start < span.end and span.start < end for span in spans)
