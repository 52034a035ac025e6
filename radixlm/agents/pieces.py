"""Tokenizing only what is new: a prompt's text cut at its added tokens (a chat template's role
markers), each piece encoded once per namespace and remembered.

A fast (Rust) tokenizer cuts its input at added tokens before anything else runs; each piece
between two of them is normalized, pre-tokenized and encoded on its own. So

    encode(A + "<|im_end|>" + B) == encode(A) + [id("<|im_end|>")] + encode(B)

whenever the added tokens match as plain text (no lstrip / rstrip / single_word, not
normalized), and then `PieceEncoder.split` finds them by the same rule (leftmost, the longest
first). A chat template writes every message between such markers, so a conversation's next
turn finds all its earlier pieces in the memo and encodes its new messages only. A tokenizer
whose added tokens match in another way, or whose pieces disagree with a whole encode on a
probe, gets no PieceEncoder (`PieceEncoder.of` is None): its prompts are encoded whole.

The memo is keyed by namespace, so how long a tokenization took never tells a tenant what
another one sent. It holds at most `capacity_chars` characters of pieces, least recently used
dropped first. Thread-safe: the server renders prompts on several tokenizer threads.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any, NamedTuple

DEFAULT_CAPACITY_CHARS = 4 << 20


class Piece(NamedTuple):
    start: int  # character offsets in the text, [start, end)
    end: int
    token_id: int | None  # an added token, or None: text encoded on its own


class Encoded(NamedTuple):
    ids: list[int]
    encoded_tokens: int  # produced by the tokenizer in this call
    reused_tokens: int  # found in the memo


class PieceEncoder:
    """Text -> ids through the memo of pieces (see the module docstring)."""

    def __init__(self, backend: Any, capacity_chars: int = DEFAULT_CAPACITY_CHARS) -> None:
        """`backend`: a `tokenizers.Tokenizer` whose added tokens all match as plain text."""
        self.backend = backend
        self.capacity_chars = capacity_chars
        added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        self._ids = added
        longest_first = sorted(added, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if added else None
        self._memo: OrderedDict[tuple[str | None, str], array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, backend: Any, capacity_chars: int = DEFAULT_CAPACITY_CHARS) -> PieceEncoder | None:
        """A PieceEncoder for this tokenizer, or None where cutting at its added tokens could
        give other ids than encoding whole (see the module docstring)."""
        if backend is None or capacity_chars <= 0:
            return None
        tokens = backend.get_added_tokens_decoder().values()
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens):
            return None
        encoder = cls(backend, capacity_chars)
        probe = _probe_text([t.content for t in tokens])
        whole = backend.encode(probe, add_special_tokens=False).ids
        pieces = encoder.encode(probe, namespace=None, remember=False).ids
        return encoder if pieces == list(whole) else None

    def split(self, text: str) -> list[Piece]:
        """`text` cut at its added tokens, in order; every character in exactly one piece."""
        pieces: list[Piece] = []
        pos = 0
        for match in self._pattern.finditer(text) if self._pattern is not None else ():
            if pos < match.start():
                pieces.append(Piece(pos, match.start(), None))
            pieces.append(Piece(match.start(), match.end(), self._ids[match.group()]))
            pos = match.end()
        if pos < len(text):
            pieces.append(Piece(pos, len(text), None))
        return pieces

    def encode(
        self,
        text: str,
        namespace: str | None,
        pieces: list[Piece] | None = None,
        remember: bool = True,
    ) -> Encoded:
        """The ids of `text` (cut by `split`, or at `pieces` when the caller has them): each
        text piece from `namespace`'s memo, or encoded and remembered there."""
        ids: list[int] = []
        encoded = reused = 0
        for start, end, token_id in pieces if pieces is not None else self.split(text):
            if token_id is not None:
                ids.append(token_id)
                continue
            piece = text[start:end]
            known = self._recall(namespace, piece) if remember else None
            if known is not None:
                ids += known
                reused += len(known)
                continue
            new = self.backend.encode(piece, add_special_tokens=False).ids
            ids += new
            encoded += len(new)
            if remember:
                self._remember(namespace, piece, new)
        return Encoded(ids, encoded, reused)

    @property
    def num_chars(self) -> int:
        """Characters of pieces remembered now (at most capacity_chars)."""
        return self._chars

    # ---- helpers ----------------------------------------------------------------------------
    def _recall(self, namespace: str | None, piece: str) -> list[int] | None:
        key = (namespace, piece)
        with self._lock:
            ids = self._memo.get(key)
            if ids is None:
                return None
            self._memo.move_to_end(key)
            return ids.tolist()

    def _remember(self, namespace: str | None, piece: str, ids: list[int]) -> None:
        if len(piece) > self.capacity_chars:
            return
        key = (namespace, piece)
        with self._lock:
            if key in self._memo:
                return
            self._memo[key] = array("i", ids)
            self._chars += len(piece)
            while self._chars > self.capacity_chars:
                (_, dropped), _ = self._memo.popitem(last=False)
                self._chars -= len(dropped)


def _probe_text(added: list[str]) -> str:
    """Every added token between texts that a tokenizer could merge across a cut: spaces and
    newlines on either side, a word run up to it."""
    around = ["a b", " c\n", "\n\n d ", "  e", "f\t", " 12 ", "\n"]
    parts = []
    for i, token in enumerate(added):
        parts += [around[i % len(around)], token]
    return "".join(parts) + around[len(added) % len(around)]
