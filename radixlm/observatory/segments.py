"""Which part of a chat prompt a character is in: the system prompt, the tools, message i's
content or header, or the generation prompt.

The renderer's own `Marks`: render the conversation again with an unguessable marker around
each message's content, here labelled with the message's index so that merged messages (tool
results joined into one turn, tools appended to the system prompt) still name the message they
came from. Tools are found by their names in the template's text outside any content, or inside
the content they were appended to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.agents.chat_format import check_messages
from radixlm.agents.prompt import Marks, PromptRenderer
from radixlm.agents.tools import ToolSpec


@dataclass(frozen=True)
class Segment:
    label: str  # "messages[2].content", "messages[2].header", "tools", "generation_prompt"
    role: str | None  # the message's role; None for tools and the generation prompt
    start: int  # character offsets in the rendered prompt, [start, end)
    end: int

    @property
    def kind(self) -> str:
        """The label without the message number ("user.content"), for grouping."""
        if self.role is None:
            return self.label
        return f"{self.role}.{self.label.rsplit('.', 1)[1]}"


@dataclass(frozen=True)
class SegmentMap:
    """A rendered chat prompt cut into segments that cover it, in order."""

    text: str
    segments: tuple[Segment, ...]

    def at(self, offset: int) -> Segment:
        """The segment holding character `offset` (the last one past the end)."""
        for segment in self.segments:
            if offset < segment.end:
                return segment
        return self.segments[-1] if self.segments else Segment("prompt", None, 0, len(self.text))


def chat_segments(
    renderer: PromptRenderer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[ToolSpec] = (),
) -> SegmentMap:
    """Segments of the prompt `renderer` writes for `messages` and `tools`. Raises ValueError
    for invalid messages, as rendering them would."""
    checked = check_messages(messages)
    marks = Marks()
    marked = []
    for i, (raw, m) in enumerate(zip(messages, checked)):
        # the content flattened; the rest of the message stays as the client sent it
        marked.append({**raw, "content": marks.wrap(m["content"] or "", str(i))})
    text, found = marks.unmark(renderer.render(marked, tools))
    spans = [(int(s.label), s.start, s.end) for s in found or ()]
    return SegmentMap(text, tuple(_cover(text, spans, checked, tools)))


def _cover(
    text: str,
    spans: list[tuple[int, int, int]],
    checked: list[dict[str, Any]],
    tools: Sequence[ToolSpec],
) -> list[Segment]:
    """Segments covering all of `text`: each content span, the header before it (template text
    up to the content) and the tools region cut out of whichever segment holds it."""
    out: list[Segment] = []
    pos, previous = 0, 0
    for i, start, end in spans:
        if pos < start:
            out.append(_between(text, checked, previous, i, pos, start))
        out.append(Segment(f"messages[{i}].content", checked[i]["role"], start, end))
        pos, previous = end, i
    if pos < len(text):
        out.append(_between(text, checked, previous, len(checked), pos, len(text)))
    region = _tools_region(text, tools)
    if region is None:
        return out
    a, b = region
    tools_seg = Segment("tools", None, a, b)
    cut: list[Segment] = []
    for s in out:
        if s.end <= a or s.start >= b:  # wholly outside the tools
            if s.start >= b and tools_seg not in cut:
                cut.append(tools_seg)
            cut.append(s)
            continue
        if s.start < a:
            cut.append(Segment(s.label, s.role, s.start, a))
        if tools_seg not in cut:
            cut.append(tools_seg)
        if s.end > b:
            cut.append(Segment(s.label, s.role, b, s.end))
    return cut


def _between(
    text: str, checked: list[dict[str, Any]], previous: int, following: int, start: int, end: int
) -> Segment:
    """The template text between two contents: an assistant message's tool calls when it holds
    one of their names (calls render outside the content), else the next message's header."""
    for k in range(previous, following):
        calls = checked[k].get("tool_calls") or ()
        if any(c["name"] in text[start:end] for c in calls):
            return Segment(f"messages[{k}].tool_calls", "assistant", start, end)
    if following == len(checked):
        return Segment("generation_prompt", None, start, end)
    return Segment(f"messages[{following}].header", checked[following]["role"], start, end)


def _tools_region(text: str, tools: Sequence[ToolSpec]) -> tuple[int, int] | None:
    """From the start of the line naming the first tool to the end of the line naming the last
    (tools render one JSON object each, sorted by name)."""
    found = [text.find(f'"{t.name}"') for t in tools]
    found = [p for p in found if p >= 0]
    if not found:
        return None
    first, last = min(found), max(found)
    start = text.rfind("\n", 0, first) + 1
    end = text.find("\n", last)
    return start, len(text) if end < 0 else end
