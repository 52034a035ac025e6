"""Why a prompt's cached prefix ended where it did: one `CacheReport` per request.

The reason is decided in this order, first fit wins:

    hit                      the whole prompt but its last token was cached: nothing to explain
    reformatted_turn         the match ends inside an assistant message that came back
                             reformatted: the same JSON value (tool arguments) in other
                             spacing or key order, the tree holding the turn as generated
    salt                     another cache_salt holds these very tokens past the segment
                             where this prompt's match ended
    evicted                  the tree had the next tokens and evicted them (when: evicted_at)
    new_content              the tree holds nothing after the match: the prompt just goes on
    different_previous_turn  the match ends inside an assistant message: the client sent back
                             an earlier turn differently from what was generated
    volatile                 a run of digits / date / time / UUID / hex id differs, and the text
                             after it is the same in the prompt and the tree
    reordered                the same JSON object is elsewhere in the other text (or the same
                             object with its keys in another order)
    new_content              otherwise: the tree holds other text here

`lost_tokens` is what a perfect client would have saved: the tree's tokens after the match that
the prompt could have reused (bounded by the prompt), the other salt's extra match, or the
evicted run. Text is decoded with special tokens, so offsets are offsets in the rendered prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from radixlm.observatory.probe import MAX_CONTINUATION, TreeProbe
from radixlm.observatory.segments import Segment, SegmentMap

REASONS = (
    "hit",
    "reformatted_turn",
    "salt",
    "evicted",
    "new_content",
    "different_previous_turn",
    "volatile",
    "reordered",
)
FIXES = {
    "salt": "requests share cached prefixes only under the same cache_salt",
    "evicted": "the cache is smaller than the working set: give it more KV slots, or send "
    "requests that share a prefix closer together",
    "reformatted_turn": "a previous turn came back reformatted (the same tool arguments, other "
    "spacing or key order): the server splices the generated ids back while it remembers the "
    "turn; send assistant messages back as received to hit in every case",
    "different_previous_turn": "send back each assistant message exactly as received "
    "(content and tool calls unchanged, nothing stripped)",
    "volatile": "move the changing value (timestamp, date, id) to the end of the prompt, "
    "after everything that stays the same",
    "reordered": "serialize objects in one stable order (sort tools, keys and lists)",
}
WINDOW = 40  # characters of text shown on each side of the divergence
Decode = Callable[[Sequence[int]], str]  # token ids -> text, special tokens included


@dataclass(frozen=True)
class CacheReport:
    reason: str  # one of REASONS
    prompt_len: int
    cached_len: int  # the position where the match ended (in tokens)
    lost_tokens: int  # prefill a perfect client would have saved
    segment: str | None  # "messages[0].content", "tools", ...; None without a chat map
    segment_kind: str | None  # the segment without its message number ("system.content")
    before: str  # the prompt's text just before the divergence
    after: str  # the prompt's text just after it
    tree_after: str | None  # what the tree holds there instead (None: nothing)
    evicted_at: float | None  # time.time() of the eviction, for "evicted"
    fix: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def explain(
    probe: TreeProbe, prompt: Sequence[int], decode: Decode, segments: SegmentMap | None = None
) -> CacheReport:
    """The report for `prompt`, from a probe of the tree taken for it (see probe.py)."""
    cached = probe.cached_len
    prefix = decode(prompt[:cached])
    rest = decode(prompt[cached : cached + MAX_CONTINUATION])  # as much as the tree's side
    tree = decode(probe.continuation) if probe.continuation else None
    segment = segments.at(len(prefix)) if segments is not None else None
    salted = probe.other_namespace_len > cached and _past(
        segments, len(prefix), len(decode(prompt[: probe.other_namespace_len]))
    )
    reason, lost = _reason(probe, len(prompt), prefix, rest, tree, segment, salted)
    return CacheReport(
        reason=reason,
        prompt_len=len(prompt),
        cached_len=cached,
        lost_tokens=lost,
        segment=segment.label if segment else None,
        segment_kind=segment.kind if segment else None,
        before=prefix[-WINDOW:],
        after=rest[:WINDOW],
        tree_after=tree[:WINDOW] if tree is not None else None,
        evicted_at=probe.evicted.evicted_at if reason == "evicted" and probe.evicted else None,
        fix=FIXES.get(reason),
    )


def text_decoder(hf_tokenizer: Any) -> Decode:
    """A Decode over a Hugging Face tokenizer: special tokens kept, no space cleanup, so the
    text is the rendered prompt's."""

    def decode(ids: Sequence[int]) -> str:
        return str(
            hf_tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    return decode


# ---- helpers --------------------------------------------------------------------------------
def _reason(
    probe: TreeProbe,
    prompt_len: int,
    prefix: str,
    rest: str,
    tree: str | None,
    segment: Segment | None,
    salted: bool,
) -> tuple[str, int]:
    cached = probe.cached_len
    if cached >= prompt_len - 1:  # the last token is always computed
        return "hit", 0
    lost = min(len(probe.continuation), prompt_len - 1 - cached)
    turn = segment if segment is not None and segment.role == "assistant" else None
    if turn is not None and tree is not None and _reformatted(prefix[turn.start :], rest, tree):
        # this namespace holds the turn as generated: whoever else holds more, this is why
        return "reformatted_turn", lost
    if salted:
        return "salt", probe.other_namespace_len - cached
    if probe.evicted is not None:
        return "evicted", probe.evicted.num_tokens
    if tree is None:
        return "new_content", 0
    if turn is not None:
        return "different_previous_turn", lost
    if _volatile(prefix, rest, tree):
        return "volatile", lost
    start = segment.start if segment is not None else prefix.rfind("\n") + 1
    if _reordered(prefix[start:], rest, tree):
        return "reordered", lost
    return "new_content", 0


def _past(segments: SegmentMap | None, own: int, other: int) -> bool:
    """Whether another salt's match (up to char `other`) holds content that ours (up to char
    `own`) does not. Every salt shares the template's first header, so matching template text
    only is no reason to blame the salt."""
    if segments is None:
        return other > own
    return any(
        s.start < other and own < s.end
        for s in segments.segments
        if s.label == "tools" or s.label.endswith(".content")
    )


# A volatile value: a run of digits, hex digits and the separators of dates, times and UUIDs
# that holds at least one digit (so plain words made of the letters a-f do not count).
_RUN = re.compile(r"(?=[0-9a-fA-F:.\-]*[0-9])[0-9a-fA-F][0-9a-fA-F:.\-]*")
_RUN_CHAR = re.compile(r"[0-9a-fA-F:.\-]")
_AGREE = 24  # characters after the values that must agree (or run to the end of a text)


def _volatile(prefix: str, rest: str, tree: str) -> bool:
    """Both texts continue a value that contains the divergence, and agree after it."""
    back = len(prefix)
    while back > 0 and _RUN_CHAR.match(prefix[back - 1]):
        back -= 1
    head = prefix[back:]
    a, b = head + rest[: 4 * _AGREE], head + tree[: 4 * _AGREE]
    run_a, run_b = _RUN.match(a), _RUN.match(b)
    if run_a is None or run_b is None or min(run_a.end(), run_b.end()) <= len(head):
        return False  # the divergence is not inside a value in both texts
    after_a, after_b = a[run_a.end() :], b[run_b.end() :]
    n = min(len(after_a), len(after_b), _AGREE)
    return _RUN.sub("#", after_a)[:n] == _RUN.sub("#", after_b)[:n]


def _reordered(common: str, rest: str, tree: str) -> bool:
    """The JSON object holding the divergence is elsewhere in the other text, or is the same
    object with its keys in another order. `common` is the shared text from the segment's
    start; both texts are cut to the same length so a truncated tree cannot look shorter."""
    n = min(len(rest), len(tree))
    objects_a = _json_objects(common + rest[:n])
    objects_b = _json_objects(common + tree[:n])
    at = len(common)
    first_a = next((o for o in objects_a if o[1] > at), None)
    first_b = next((o for o in objects_b if o[1] > at), None)
    if first_a is None or first_b is None:
        return False
    canon_a, canon_b = {o[2] for o in objects_a}, {o[2] for o in objects_b}
    return first_a[2] == first_b[2] or first_a[2] in canon_b or first_b[2] in canon_a


def _reformatted(common: str, rest: str, tree: str) -> bool:
    """The JSON object holding the divergence is the same value on both sides."""
    n = min(len(rest), len(tree))
    at = len(common)
    first_a = next((o for o in _json_objects(common + rest[:n]) if o[1] > at), None)
    first_b = next((o for o in _json_objects(common + tree[:n]) if o[1] > at), None)
    return first_a is not None and first_b is not None and first_a[2] == first_b[2]


def _json_objects(text: str) -> list[tuple[int, int, str]]:
    """(start, end, canonical JSON) of each top-level JSON object in `text`."""
    decoder = json.JSONDecoder()
    out: list[tuple[int, int, str]] = []
    pos = text.find("{")
    while pos >= 0:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            pos = text.find("{", pos + 1)
            continue
        out.append((pos, end, json.dumps(value, sort_keys=True)))
        pos = text.find("{", end)
    return out
