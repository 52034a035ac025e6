"""Tool calls out of generated text: whole (`parse_tool_calls`) or as streamed deltas.

The built-in format (see `chat_format`) is

    <free text> <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call> <more calls>

`ToolCallParser` is one state machine for both uses, so a stream's deltas reassemble into exactly
the calls the whole-text parser finds, however the text was cut into deltas:

    text ──<tool_call>──► header ──"arguments":──► arguments ──balanced──► close ──► text
                             │ (no header)            (JSON braces counted,        │
                             └─► back to text as       strings skipped)            └ bad: skip

Rules: whitespace next to a call is not content; text that only might start a tag is held back
until it is decided; arguments stream as they arrive, verbatim. A block that is not a call stays
text. The streaming parser cannot take back a call whose name it already sent, so it keeps a call
whose arguments turn out to be malformed; the whole-text parser turns such a call back into text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from radixlm.agents.chat_format import CALL_CLOSE, CALL_OPEN

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"\s*,\s*"arguments"\s*:\s*')
_MAX_HEADER = 512  # characters after <tool_call> that may still turn out to be a header


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the arguments' JSON text, verbatim
    raw: str = ""  # the call's whole text, from <tool_call> on
    complete: bool = False  # arguments balanced and the block closed (or the text ended)

    def to_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallDelta:
    """A streamed increment of call `index`: its first one carries id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParseDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the output was calls only
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str) -> ParsedOutput:
    """The calls in a whole output and the text around them. A call whose arguments are not a
    JSON object, or whose block is cut off inside the arguments, stays text."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    content: list[str] = []
    calls: list[ToolCall] = []
    for segment in parser.segments:
        if isinstance(segment, str):
            content.append(segment)
        elif _valid(parser.calls[segment]):
            calls.append(parser.calls[segment])
        else:
            content.append(parser.calls[segment].raw)
    joined = "".join(content)
    return ParsedOutput(joined if joined or not calls else None, calls)


class ToolCallParser:
    """The state machine of the module docstring. `feed` returns what is decided so far."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.segments: list[str | int] = []  # content text and call indices, in order
        self._state = "text"
        self._buf = ""  # text received but not yet decided
        self._after_call = False  # whitespace right after a call is dropped
        self._depth, self._in_string, self._escape = 0, False, False

    def feed(self, text: str) -> ParseDelta:
        out = ParseDelta()
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> ParseDelta:
        """Decide whatever is held back: the text has ended."""
        out = ParseDelta()
        self._run(out, final=True)
        return out

    # ---- states -----------------------------------------------------------------------------
    def _run(self, out: ParseDelta, final: bool) -> None:
        step = {"text": self._text, "header": self._header, "arguments": self._arguments,
                "close": self._close, "skip": self._skip}  # fmt: skip
        while step[self._state](out, final):
            pass

    def _text(self, out: ParseDelta, final: bool) -> bool:
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        at = self._buf.find(CALL_OPEN)
        if at >= 0:
            self._emit(out, self._buf[:at].rstrip())
            self._buf = self._buf[at + len(CALL_OPEN) :]
            self._state = "header"
            return True
        if final:
            self._emit(out, self._buf)
            self._buf = ""
            return False
        held = _partial_tag(self._buf)  # a suffix that may grow into <tool_call>
        ready = self._buf[: len(self._buf) - held]
        decided = ready.rstrip()  # trailing whitespace waits: a call may follow it
        self._emit(out, decided)
        self._buf = self._buf[len(decided) :]
        return False

    def _header(self, out: ParseDelta, final: bool) -> bool:
        match = _HEADER.match(self._buf)
        if match:
            name = json.loads(f'"{match.group(1)}"')
            call = ToolCall(new_call_id(), name, raw=CALL_OPEN + self._buf[: match.end()])
            self.segments.append(len(self.calls))
            self.calls.append(call)
            out.calls.append(CallDelta(len(self.calls) - 1, "", call.id, name))
            self._buf = self._buf[match.end() :]
            self._state = "arguments"
            self._depth, self._in_string, self._escape = 0, False, False
            return True
        if final or CALL_CLOSE in self._buf or len(self._buf) > _MAX_HEADER:
            self._emit(out, CALL_OPEN)  # not a call: the tag is text, scanning goes on after it
            self._state = "text"
            return True
        return False

    def _arguments(self, out: ParseDelta, final: bool) -> bool:
        call = self.calls[-1]
        taken, done = self._scan_json(self._buf)
        lead = len(taken) - len(taken.lstrip()) if not call.arguments else 0
        fragment = taken[lead:]
        call.raw += taken
        if fragment:
            call.arguments += fragment
            out.calls.append(CallDelta(len(self.calls) - 1, fragment))
        self._buf = self._buf[len(taken) :]
        if done:
            self._state = "close"
            return True
        if self._buf:  # the arguments do not start with "{": not a call we can stream
            self._state = "skip"
            return True
        return False

    def _close(self, out: ParseDelta, final: bool) -> bool:
        call = self.calls[-1]
        rest = self._buf.lstrip()
        after = rest[1:].lstrip() if rest.startswith("}") else None
        if after is not None and after.startswith(CALL_CLOSE):
            end = len(self._buf) - len(after) + len(CALL_CLOSE)
            call.raw += self._buf[:end]
            call.complete = True
            self._buf = self._buf[end:]
            self._state, self._after_call = "text", True
            return True
        if rest and (after is None or not CALL_CLOSE.startswith(after)):
            self._state = "skip"
            return True
        if final:  # the text ended inside a well-formed call (no closing tag): keep it
            call.raw += self._buf
            call.complete = True
            self._buf = ""
            self._state = "text"
        return False

    def _skip(self, out: ParseDelta, final: bool) -> bool:
        """A malformed call: its text up to the closing tag belongs to it."""
        at = self._buf.find(CALL_CLOSE)
        if at < 0 and not final:
            return False
        end = len(self._buf) if at < 0 else at + len(CALL_CLOSE)
        self.calls[-1].raw += self._buf[:end]
        self._buf = self._buf[end:]
        self._state, self._after_call = "text", True
        return True

    # ---- helpers ----------------------------------------------------------------------------
    def _emit(self, out: ParseDelta, text: str) -> None:
        if not text:
            return
        out.content += text
        if self.segments and isinstance(self.segments[-1], str):
            self.segments[-1] += text
        else:
            self.segments.append(text)

    def _scan_json(self, text: str) -> tuple[str, bool]:
        """The prefix of `text` that continues the arguments object, and whether it closed it.
        Leading whitespace is taken; anything but "{" where the object must start stops."""
        for i, ch in enumerate(text):
            if self._depth == 0:
                if ch.isspace():
                    continue
                if ch != "{":
                    return text[:i], False
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return text[: i + 1], True
        return text, False


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of <tool_call>."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _valid(call: ToolCall) -> bool:
    if not call.complete:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except json.JSONDecodeError:
        return False
