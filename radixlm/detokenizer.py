"""From sampled token ids to streamed text, and the rules that end a request's output.

- `IncrementalDetokenizer`: token ids in, text deltas out. The deltas never contain text that a
  later token would change (half a UTF-8 character, a leading space that depends on context), and
  they concatenate to `Tokenizer.decode` of all the ids.
- `StopChecker`: text deltas in, the text that is safe to show out. It finds the first stop
  string even when it spans tokens, and holds back a tail that could still become one.
- `OutputStream`: both of the above plus stop tokens, eos and max_tokens, for one output (one per
  sample when n > 1). The engine pushes every sampled token and finishes the request when the
  returned `finish_reason` is set; it is the one place that decides why an output ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from radixlm.request import FinishReason, SamplingParams
from radixlm.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    Each step decodes a short window: ids[prefix_offset:], whose first part
    ids[prefix_offset:read_offset] was already emitted. Decoding with that context gives the new
    tokens their context-dependent text (the space a sentencepiece "▁" token loses at the start
    of a decode, the bytes a byte-level token shares with its neighbours); the delta is what the
    window's text adds to the context's. The window starts where earlier text ended on a whole
    character, and its context always has text of its own.

    One exception to "deltas add up to the full decode": a ByteFallback decoder (sentencepiece
    byte tokens <0xNN>) turns every byte of a run that is not valid UTF-8 into U+FFFD, even the
    bytes that were whole characters when they were streamed. The stream keeps those characters,
    so for such invalid output it differs from `decode`; for valid UTF-8 it never does.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])

    def push(self, token_ids: Iterable[int]) -> str:
        """Append ids and return the text they complete ("" while a character is incomplete)."""
        self.token_ids.extend(token_ids)
        window = self._decode_from(self._prefix_offset)
        if window.endswith(_REPLACEMENT):
            return ""  # perhaps the first bytes of a character; wait for the rest
        delta = window[len(self._prefix_text) :]  # the window starts with its context's text
        self._advance(window)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text still held back, incomplete characters included (as U+FFFD); call at the end."""
        delta = self._decode_from(self._prefix_offset)[len(self._prefix_text) :]
        self._advance(self._prefix_text + delta)
        self.text += delta
        return delta

    def _advance(self, window: str) -> None:
        """Everything up to the last id is emitted: the unread ids become the next context."""
        unread_text = self._tokenizer.decode(self.token_ids[self._read_offset :])
        if unread_text:
            self._prefix_offset, self._prefix_text = self._read_offset, unread_text
        else:  # only special tokens since the last read: keep the context that has text
            self._prefix_text = window
        self._read_offset = len(self.token_ids)

    def _decode_from(self, start: int) -> str:
        return self._tokenizer.decode(self.token_ids[start:])


class StopMatch(NamedTuple):
    text: str  # safe to emit now; on a stop, everything before the stop string
    stop: str | None  # the stop string found, or None while the output goes on


class StopChecker:
    """Finds the first of some stop strings in text that arrives in pieces.

    The output stops at the earliest place where a stop string occurs in the text pushed so far
    (checked after every piece, as a streaming server must). The stop string itself is never
    emitted. After a stop, `push` raises.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._held = ""  # the longest tail that is a proper prefix of some stop string
        self.stopped: str | None = None

    def push(self, text: str) -> StopMatch:
        """Add `text`; return what may be shown now and the stop string if one completed."""
        if self.stopped is not None:
            raise RuntimeError(f"output already stopped at {self.stopped!r}")
        buffer = self._held + text
        # An occurrence cannot start before the held tail: earlier text was already checked.
        found = [(buffer.find(s), s) for s in self._stop if s in buffer]
        if found:
            start, stop = min(found, key=lambda f: f[0])
            self._held, self.stopped = "", stop
            return StopMatch(buffer[:start], stop)
        keep = _partial_stop_len(buffer, self._stop)
        self._held = buffer[len(buffer) - keep :]
        return StopMatch(buffer[: len(buffer) - keep], None)

    def flush(self) -> str:
        """The held-back tail, when the output ends for another reason."""
        held, self._held = self._held, ""
        return held


def _partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


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

    def _finish(self, reason: FinishReason, text: str, flush: bool = True) -> TextDelta:
        if flush:  # emit what was held back for a character or a stop string that never came
            match = self._stop_checker.push(self._detokenizer.flush())
            text += match.text
            if match.stop is None:
                text += self._stop_checker.flush()
        self.text += text
        self.finish_reason = reason
        return TextDelta(text, reason)
