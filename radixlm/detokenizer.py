"""From sampled token ids to streamed text, and the rules that end a request's output.

- `IncrementalDetokenizer`: token ids in, text deltas out. The deltas never contain text that a
  later token would change (half a UTF-8 character, a leading space that depends on context), and
  they concatenate to `Tokenizer.decode` of all the ids.
- `StopChecker`: text deltas in, the text that is safe to show out. It finds the first stop
  string even when it spans tokens, and holds back a tail that could still become one; its work
  is linear in the text added, whatever the stop strings.
- `OutputStream`: both of the above plus stop tokens, eos and max_tokens, for one output (one per
  sample when n > 1). The engine pushes every sampled token and finishes the request when the
  returned `finish_reason` is set; it is the one place that decides why an output ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from radixlm.api_types import FinishReason, SamplingParams
from radixlm.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
# Unread ids after which a text still ending in U+FFFD is taken as invalid, not incomplete:
# a character has at most 4 bytes, and every id that is not skipped holds at least one.
MAX_UNREAD = 32


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    Each step decodes a short window: the context (ids already emitted, whose text is
    `_prefix_text`) followed by the unread ids. Decoding with that context gives the new tokens
    their context-dependent text (the space a sentencepiece "▁" token loses at the start of a
    decode, the bytes a byte-level token shares with its neighbours); the delta is what the
    window's text adds to the context's. The window starts where earlier text ended on a whole
    character, and its context always has text of its own.

    Bounded work: a push decodes O(window) ids, and the window stays short. Special tokens
    (which the decode skips) never join the context, so a run of them costs nothing later; and
    when more than MAX_UNREAD ids in a row leave the text ending in an incomplete character,
    they are not UTF-8 that any next id could complete (a character has at most 4 bytes), and
    their text (U+FFFD) is emitted.

    One exception to "deltas add up to the full decode": a ByteFallback decoder (sentencepiece
    byte tokens <0xNN>) turns every byte of a run that is not valid UTF-8 into U+FFFD, even the
    bytes that were whole characters when they were streamed. The stream keeps those characters,
    so for such invalid output it differs from `decode`; for valid UTF-8 it never does.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        hf = getattr(tokenizer, "hf_tokenizer", None)
        self._skipped = frozenset(getattr(hf, "all_special_ids", ()) or ())  # decode drops them
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._context: list[int] = []  # ids before the unread ones, whose text is _prefix_text
        self._unread: list[int] = []
        self._prefix_text = ""  # decode(_context)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append ids and return the text they complete ("" while a character is incomplete)."""
        new = list(token_ids)
        self.token_ids.extend(new)
        self._unread.extend(new)
        window = self._tokenizer.decode(self._context + self._unread)
        if window.endswith(_REPLACEMENT) and len(self._unread) <= MAX_UNREAD:
            return ""  # perhaps the first bytes of a character; wait for the rest
        delta = window[len(self._prefix_text) :]  # the window starts with its context's text
        self._advance(window)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text still held back, incomplete characters included (as U+FFFD); call at the end."""
        window = self._tokenizer.decode(self._context + self._unread)
        delta = window[len(self._prefix_text) :]
        self._advance(window)
        self.text += delta
        return delta

    def _advance(self, window: str) -> None:
        """Everything up to the last id is emitted: the unread ids become the next context."""
        unread_text = self._tokenizer.decode(self._unread)
        if unread_text:
            self._context, self._prefix_text = self._unread, unread_text
        else:  # no text since the last read: keep the context that has text, and these ids
            # (but the special ones: the decode skips them, so dropping them changes nothing)
            self._context = self._context + [t for t in self._unread if t not in self._skipped]
            self._prefix_text = window
        self._unread = []


class StopMatch(NamedTuple):
    text: str  # safe to emit now; on a stop, everything before the stop string
    stop: str | None  # the stop string found, or None while the output goes on


class StopChecker:
    """Finds the first of some stop strings in text that arrives in pieces.

    The output stops at the earliest place where a stop string occurs in the text pushed so far
    (checked after every piece, as a streaming server must). The stop string itself is never
    emitted. After a stop, `push` raises.

    Work is linear in the text pushed, whatever the stop strings' lengths: each stop string is
    matched by Knuth-Morris-Pratt, its state the longest suffix of the text that begins it, so the
    text held back is the longest of those states and a piece is scanned once per stop string;
    the held text is a queue of pieces, emitted without copying what stays. `work` counts the
    characters scanned and emitted (the tests bound it).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = [_StopString(s) for s in stop]
        self._held: deque[str] = deque()  # text not yet emitted, oldest first
        self._held_start = 0  # characters of _held[0] emitted already
        self._held_len = 0
        self.stopped: str | None = None
        self.work = 0

    def push(self, text: str) -> StopMatch:
        """Add `text`; return what may be shown now and the stop string if one completed."""
        if self.stopped is not None:
            raise RuntimeError(f"output already stopped at {self.stopped!r}")
        base = self._held_len  # where `text` starts in the held text + text
        first: tuple[int, str] | None = None  # (start in held + text, stop string)
        for stop in self._stops:
            end = stop.feed(text)
            if end >= 0 and (first is None or base + end - len(stop.text) < first[0]):
                first = (base + end - len(stop.text), stop.text)
        self.work += sum(stop.take_work() for stop in self._stops)
        self._hold(text)
        if first is not None:
            start, self.stopped = first
            shown = self._emit(start)
            self._held.clear()
            self._held_start = self._held_len = 0
            return StopMatch(shown, self.stopped)
        keep = max((stop.matched for stop in self._stops), default=0)
        return StopMatch(self._emit(self._held_len - keep), None)

    def flush(self) -> str:
        """The held-back tail, when the output ends for another reason."""
        return self._emit(self._held_len)

    def _hold(self, text: str) -> None:
        if text:
            self._held.append(text)
            self._held_len += len(text)

    def _emit(self, num_chars: int) -> str:
        """The first `num_chars` held characters, taken out of the queue."""
        parts: list[str] = []
        left = num_chars
        while left > 0:
            piece = self._held[0]
            take = min(left, len(piece) - self._held_start)
            parts.append(piece[self._held_start : self._held_start + take])
            left -= take
            self._held_start += take
            if self._held_start == len(piece):
                self._held.popleft()
                self._held_start = 0
        self._held_len -= num_chars
        self.work += num_chars
        return "".join(parts)


class _StopString:
    """One stop string under Knuth-Morris-Pratt. Its failure function (`_border[j]`: the longest
    proper border of text[:j + 1]) is built only as deep as the output has matched, so a
    megabyte stop string costs what the output follows of it, not its length."""

    __slots__ = ("_border", "_work", "matched", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.matched = 0  # the longest suffix of the text so far that is a prefix of `text`
        self._border = [0]
        self._work = 0

    def feed(self, piece: str) -> int:
        """Advance over `piece`; the index in it just past the first whole occurrence, or -1."""
        s, k, border, n = self.text, self.matched, self._border, len(self.text)
        i, size = 0, len(piece)
        while i < size:
            if k == 0:  # skip to the next place the stop string could begin (a C scan)
                found = piece.find(s[0], i)
                self._work += (size if found < 0 else found) - i + 1
                if found < 0:
                    break
                i = found
            c = piece[i]
            while k and s[k] != c:
                k = border[k - 1]
                self._work += 1
            if s[k] == c:
                k += 1
                if k == n:
                    self.matched = k
                    return i + 1
                self._extend(k)
            i += 1
            self._work += 1
        self.matched = k
        return -1

    def take_work(self) -> int:
        work, self._work = self._work, 0
        return work

    def _extend(self, depth: int) -> None:
        """Borders for every prefix up to `depth` characters (one more, amortized, per call)."""
        s, border = self.text, self._border
        for j in range(len(border), depth):
            b = border[j - 1]
            while b and s[j] != s[b]:
                b = border[b - 1]
                self._work += 1
            border.append(b + 1 if s[j] == s[b] else b)
            self._work += 1


class TextDelta(NamedTuple):
    text: str  # new output text for the client (may be "")
    finish_reason: FinishReason | None  # "stop" or "length" when it ends here, else None


class OutputStream:
    """One output of a request: sampled token ids in, text deltas and the finish reason out.

    Push every sampled token, in order. The output finishes with
    - "stop" on a token of `params.stop_token_ids`, or of `tokenizer.eos_token_ids` unless
      `params.ignore_eos`: that token is kept in `token_ids` but its text is not emitted;
    - "stop" when the text contains a stop string: the text ends before it;
    - "length" when `token_ids` reaches `params.max_tokens`.
    Then every held-back character has been emitted, `text` is the whole output text, and
    `push` raises.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._params = params
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(tokenizer.eos_token_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop_checker = StopChecker(params.stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None

    def push(self, token_id: int) -> TextDelta:
        """Add one sampled token; return its text delta and the finish reason, if it ends here."""
        if self.finish_reason is not None:
            raise RuntimeError(f"output already finished ({self.finish_reason})")
        self.token_ids.append(token_id)
        if token_id in self._stop_ids:
            return self._finish("stop", "")
        match = self._stop_checker.push(self._detokenizer.push([token_id]))
        if match.stop is not None:
            return self._finish("stop", match.text, flush=False)
        if len(self.token_ids) >= self._params.max_tokens:
            return self._finish("length", match.text)
        self.text += match.text
        return TextDelta(match.text, None)

    @property
    def stop_work(self) -> int:
        """Characters the stop-string check scanned and emitted so far (linear in the text)."""
        return self._stop_checker.work

    def _finish(self, reason: FinishReason, text: str, flush: bool = True) -> TextDelta:
        if flush:  # emit what was held back for a character or a stop string that never came
            match = self._stop_checker.push(self._detokenizer.flush())
            text += match.text
            if match.stop is None:
                text += self._stop_checker.flush()
        self.text += text
        self.finish_reason = reason
        return TextDelta(text, reason)
