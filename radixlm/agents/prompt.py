"""Prompt token ids for a chat in which earlier assistant turns are the ids the model generated.

An agent resends the whole conversation every step. The prefix cache holds the previous step's
prompt and the ids the model generated; if re-rendering the returned assistant message produced
different ids (BPE has many spellings of one text, and a grammar may pick a rare one) the match
would end at the start of that turn and everything after it would be computed again.

So the server remembers (`TurnMemo`) the ids behind every assistant message it returned, keyed by
what the message says (content and tool calls), and `PromptRenderer` splices them in:

    rendered text:  [segment 0] <turn 1> [segment 1] <turn 2> [segment 2]
    prompt ids:     encode(seg 0) + ids(turn 1) + encode(seg 1) + ids(turn 2) + encode(seg 2)

Segment 0 is the text of the step-1 prompt and is encoded by the same function, so step 2's ids
start with step 1's prompt + output: the cache match ends where the new messages begin.

Message content is text, never control: a segment whose content spells a special token
(`<|im_start|>` typed by a user) encodes that content without special-token parsing.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from radixlm.agents.chat_format import (
    check_messages,
    template_renders_tools,
    template_tools,
    to_template_messages,
)
from radixlm.agents.tools import ToolSpec, canonical_json
from radixlm.tokenizer import NoChatTemplateError, Tokenizer

Calls = Sequence[tuple[str, str]]  # (name, arguments) of an assistant message's tool calls


class TurnMemo:
    """What each returned assistant message was as token ids, least recently used dropped.

    Keyed by (namespace, content, tool calls): ids never cross a cache_salt. Thread-safe: the
    server records from its event loop and renders in worker threads.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(
        self, namespace: str | None, content: str | None, calls: Calls, ids: Sequence[int]
    ) -> None:
        key = _key(namespace, content, calls)
        with self._lock:
            self._ids[key] = tuple(ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def recall(
        self, namespace: str | None, content: str | None, calls: Calls
    ) -> tuple[int, ...] | None:
        key = _key(namespace, content, calls)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
            return ids

    def __len__(self) -> int:
        return len(self._ids)


class PromptRenderer:
    """Chat messages (+ tools) -> prompt ids, splicing remembered assistant turns."""

    def __init__(self, tokenizer: Tokenizer, memo: TurnMemo | None = None) -> None:
        self.tokenizer = tokenizer
        self.memo = memo
        hf = tokenizer.hf_tokenizer
        self.native_tools = template_renders_tools(hf)
        self._special = _special_ids(hf)
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
        """Token ids of the prompt. Raises ValueError for invalid messages and
        NoChatTemplateError when the tokenizer has no template."""
        checked = check_messages(messages)
        conversation = to_template_messages(checked, tools, self.native_tools)
        nonce = secrets.token_hex(8)
        open_mark, close_mark, turn_mark = (f"\ue000{nonce}{c}" for c in "\ue001\ue002\ue003")
        turns = self._remembered_turns(checked, namespace)
        marked = []
        assistant = 0
        for m in conversation:
            m = dict(m)
            if m["role"] == "assistant":
                if assistant in turns:  # its ids are known: render a placeholder
                    m["content"] = f"{turn_mark}{assistant}{turn_mark}"
                    m.pop("tool_calls", None)
                else:
                    m["content"] = _wrap(m["content"], open_mark, close_mark)
                assistant += 1
            else:
                m["content"] = _wrap(m["content"], open_mark, close_mark)
            marked.append(m)
        turn_pattern = f"{re.escape(turn_mark)}(\\d+){re.escape(turn_mark)}"
        pieces = re.split(turn_pattern, self._template(marked, tools))
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if j % 2:
                ids += turns[int(piece)]
            else:
                ids += self._encode_segment(piece, open_mark, close_mark)
        return ids

    # ---- helpers ----------------------------------------------------------------------------
    def _remembered_turns(
        self, checked: list[dict[str, Any]], namespace: str | None
    ) -> dict[int, tuple[int, ...]]:
        """assistant message number -> remembered ids, for the assistant turns the memo has."""
        turns: dict[int, tuple[int, ...]] = {}
        if self.memo is None:
            return turns
        assistants = [m for m in checked if m["role"] == "assistant"]
        for i, m in enumerate(assistants):
            calls = [(c["name"], c["arguments"]) for c in m.get("tool_calls", ())]
            ids = self.memo.recall(namespace, m["content"], calls)
            if ids is not None:
                turns[i] = ids
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

    def _encode_segment(self, marked: str, open_mark: str, close_mark: str) -> list[int]:
        """Ids of one segment of rendered text whose message contents sit between marks.

        The whole text is encoded at once unless a special token overlaps a content span; then
        contents are encoded without special-token parsing and the template's text with it.
        """
        text, spans = _unmark(marked, open_mark, close_mark)
        if spans is None or self._backend is None:
            # No positions (the template transforms content) or no offsets (a slow tokenizer):
            # refuse content that would forge, encode the rest whole.
            if self._forges(_contents(marked, open_mark, close_mark)):
                raise ValueError(_FORGED)
            return self.tokenizer.encode(text, add_special_tokens=False)
        encoding = self._backend.encode(text, add_special_tokens=False)
        forged = any(
            token in self._special and _overlaps(offset, spans)
            for token, offset in zip(encoding.ids, encoding.offsets)
        )
        if not forged:
            return list(encoding.ids)
        ids: list[int] = []
        pos = 0
        for a, b in [*spans, (len(text), len(text))]:
            if pos < a:
                ids += self._backend.encode(text[pos:a], add_special_tokens=False).ids
            if a < b:
                ids += self._plain.encode(text[a:b], add_special_tokens=False).ids
            pos = b
        return ids

    def _forges(self, contents: list[str]) -> bool:
        return any(
            t in self._special
            for content in contents
            for t in self.tokenizer.encode(content, add_special_tokens=False)
        )


_FORGED = (
    "message content contains special-token text (such as a chat template's role markers), "
    "which this model's tokenizer cannot encode as plain text"
)


def _key(namespace: str | None, content: str | None, calls: Calls) -> str:
    return canonical_json([namespace, content or "", [list(c) for c in calls]])


def _wrap(content: str, open_mark: str, close_mark: str) -> str:
    """Marks around the content's core; edge whitespace stays outside, where a template's trim
    finds it."""
    core = content.strip()
    if not core:
        return content
    lead = content[: len(content) - len(content.lstrip())]
    trail = content[len(content.rstrip()) :]
    return f"{lead}{open_mark}{core}{close_mark}{trail}"


def _unmark(
    marked: str, open_mark: str, close_mark: str
) -> tuple[str, list[tuple[int, int]] | None]:
    """The text without marks and the content spans they delimited; None for the spans when the
    template dropped or doubled a mark (it transforms content: positions cannot be trusted)."""
    spans: list[tuple[int, int]] = []
    out: list[str] = []
    length, opened, pos = 0, None, 0
    for match in re.finditer(f"{re.escape(open_mark)}|{re.escape(close_mark)}", marked):
        out.append(marked[pos : match.start()])
        length += match.start() - pos
        pos = match.end()
        if (match.group() == open_mark) != (opened is None):
            return "".join(out) + marked[pos:].replace(open_mark, "").replace(close_mark, ""), None
        if opened is None:
            opened = length
        else:
            spans.append((opened, length))
            opened = None
    out.append(marked[pos:])
    return "".join(out), None if opened is not None else spans


def _contents(marked: str, open_mark: str, close_mark: str) -> list[str]:
    """Whatever lies between an open mark and the next close mark (best effort)."""
    pattern = f"{re.escape(open_mark)}(.*?){re.escape(close_mark)}"
    return re.findall(pattern, marked, flags=re.DOTALL)


def _overlaps(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    start, end = offset
    return any(start < b and a < end for a, b in spans)


def _special_ids(hf: Any) -> frozenset[int]:
    ids = {int(i) for i, t in hf.added_tokens_decoder.items() if t.special}
    ids.update(int(i) for i in hf.all_special_ids)
    return frozenset(ids)
