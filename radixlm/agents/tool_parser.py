"""Tool calls out of generated text: whole (`parse_tool_calls`) or as streamed deltas.

The built-in format (see `chat_format`) is

    <free text> <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call> <more calls>

`ToolCallParser` is one state machine for both uses, so a stream's deltas reassemble into exactly
the content and calls the whole-text parser finds, however the text was cut into deltas:

    text ──<tool_call>──► header ──"arguments":──► arguments ──balanced──► close ──► text
                             │ (no header)            (JSON braces counted,        │
                             └─► back to text as       strings skipped)            └ bad: skip

Rules: whitespace next to a call is not content (next to a block that is not a call, it is);
text that only might start a tag is held back until it is decided, and so is a call until it is
closed: a call is sent whole (id, name and arguments in one delta) once its closing tag arrives,
so a client never receives a call that is then cut off or malformed. A block that is not a call
is text. When the text ends (`finish`), a call whose arguments are complete but whose closing
tag never came is a call if the output stopped by itself, and text if it was cut (max_tokens):
an unclosed call is never emitted.
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
    complete: bool = False  # arguments balanced and the block closed (or the output stopped)

    def to_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallDelta:
    """Call `index` of a stream, sent whole once it is complete."""

    index: int
    arguments: str
    id: str
    name: str


@dataclass
class ParseDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the output was calls only
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, cut: bool = False) -> ParsedOutput:
    """The calls in a whole output and the text around them; `cut`: the output was cut off
    (max_tokens), so a call without its closing tag stays text."""
    parser = ToolCallParser()
    first, rest = parser.feed(text), parser.finish(cut)
    content = first.content + rest.content
    return ParsedOutput(content if content or not parser.calls else None, parser.calls)


class ToolCallParser:
    """The state machine of the module docstring. `feed` returns what is decided so far."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []  # the calls sent, in order (their index is their place)
        self._call: ToolCall | None = None  # the call being read
        self._state = "text"
        self._buf = ""  # text received but not yet decided
        self._lead = ""  # whitespace before the tag being read: text unless a call follows
        self._after_call = False  # whitespace right after a call is dropped
        self._depth, self._in_string, self._escape = 0, False, False

    def feed(self, text: str) -> ParseDelta:
        out = ParseDelta()
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self, cut: bool = False) -> ParseDelta:
        """Decide whatever is held back: the text has ended (`cut`: by max_tokens)."""
        out = ParseDelta()
        self._run(out, final=True)
        call = self._call
        if call is not None:  # the text ended inside a call
            rest, self._buf = self._buf, ""
            self._end_call(out, call.raw + rest, complete=self._state == "close" and not cut)
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
            before = self._buf[:at]
            out.content += before.rstrip()
            self._lead = before[len(before.rstrip()) :]
            self._buf = self._buf[at + len(CALL_OPEN) :]
            self._state = "header"
            return True
        if final:
            out.content += self._buf
            self._buf = ""
            return False
        held = _partial_tag(self._buf)  # a suffix that may grow into <tool_call>
        ready = self._buf[: len(self._buf) - held]
        decided = ready.rstrip()  # trailing whitespace waits: a call may follow it
        out.content += decided
        self._buf = self._buf[len(decided) :]
        return False

    def _header(self, out: ParseDelta, final: bool) -> bool:
        match = _HEADER.match(self._buf)
        if match:
            name = json.loads(f'"{match.group(1)}"')
            self._call = ToolCall(new_call_id(), name, raw=CALL_OPEN + self._buf[: match.end()])
            self._buf = self._buf[match.end() :]
            self._state = "arguments"
            self._depth, self._in_string, self._escape = 0, False, False
            return True
        if final or CALL_CLOSE in self._buf or len(self._buf) > _MAX_HEADER:
            out.content += self._lead + CALL_OPEN  # not a call: the tag is text, scanning
            self._state = "text"  # goes on after it
            return True
        return False

    def _arguments(self, out: ParseDelta, final: bool) -> bool:
        call = self._call
        assert call is not None
        taken, done = self._scan_json(self._buf)
        call.raw += taken
        call.arguments += taken if call.arguments else taken.lstrip()
        self._buf = self._buf[len(taken) :]
        if done:
            self._state = "close"
            return True
        if self._buf:  # the arguments do not start with "{": not a call
            self._state = "skip"
            return True
        return False

    def _close(self, out: ParseDelta, final: bool) -> bool:
        call = self._call
        assert call is not None
        rest = self._buf.lstrip()
        after = rest[1:].lstrip() if rest.startswith("}") else None
        if after is not None and after.startswith(CALL_CLOSE):
            end = len(self._buf) - len(after) + len(CALL_CLOSE)
            self._end_call(out, call.raw + self._buf[:end], complete=True)
            self._buf = self._buf[end:]
            return True
        if rest and (after is None or not CALL_CLOSE.startswith(after)):
            self._state = "skip"
            return True
        return False  # the closing tag may still come (finish decides if it never does)

    def _skip(self, out: ParseDelta, final: bool) -> bool:
        """A malformed call: its text up to the closing tag belongs to it, and is text."""
        call = self._call
        assert call is not None
        at = self._buf.find(CALL_CLOSE)
        if at < 0:
            return False  # finish() turns the rest into text if the tag never comes
        end = at + len(CALL_CLOSE)
        self._end_call(out, call.raw + self._buf[:end], complete=False)
        self._buf = self._buf[end:]
        return True

    # ---- helpers ----------------------------------------------------------------------------
    def _end_call(self, out: ParseDelta, raw: str, complete: bool) -> None:
        """The call being read is over: sent whole when it is a call, else its text is text."""
        call = self._call
        assert call is not None
        call.raw, call.complete = raw, complete
        made = complete and _valid(call)
        if made:
            out.calls.append(CallDelta(len(self.calls), call.arguments, call.id, call.name))
            self.calls.append(call)
        else:  # not a call: its text, with the whitespace around it, is content
            out.content += self._lead + raw
        self._call = None
        self._state, self._after_call = "text", made

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
