"""The ids behind each assistant turn the server returned, found again by what the turn says.

An agent resends its whole conversation every step. If the returned assistant message came back
as other ids than the model generated (BPE has many spellings of one text; a framework
re-serializes tool arguments, `{"city":"Oslo"}` for `{"city": "Oslo"}`), the cache match would
end at the start of that turn. So turns are remembered and recalled by meaning:

- content compared as text, exactly;
- each call by name and arguments compared as parsed JSON (keys in any order, any spacing);
  arguments that are not one JSON value, or that repeat a key, compare as text.

Only ids the client saw are remembered (`turn_ids`): no special token (a control token
generated under a `logit_bias` never reaches the next prompt), and they decode to exactly the
text that was returned (a stop string cuts text, not ids).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from radixlm.agents.tools import canonical_json
from radixlm.tokenizer import Tokenizer

Calls = Sequence[tuple[str, str]]  # (name, arguments) of an assistant message's tool calls


class Turn(NamedTuple):
    """One assistant message as the model generated it."""

    content: str | None
    calls: tuple[tuple[str, str], ...]
    ids: tuple[int, ...]

    @property
    def key(self) -> str:
        return turn_key(self.content, self.calls)


def turn_key(content: str | None, calls: Calls) -> str:
    """What a turn means: equal keys for the same content and the same calls (see above)."""
    return canonical_json([content or "", [[name, _arguments_key(args)] for name, args in calls]])


def turn_ids(tokenizer: Tokenizer, text: str, token_ids: Sequence[int]) -> tuple[int, ...] | None:
    """The ids to remember for an output whose text the client got, or None when they are not
    exactly what the client saw. A trailing end-of-sequence id is dropped: the template writes
    the turn's end itself."""
    ids = list(token_ids)
    if ids and ids[-1] in tokenizer.eos_token_ids:
        ids.pop()
    if not ids or any(t in tokenizer.special_ids for t in ids):
        return None
    return tuple(ids) if tokenizer.decode(ids) == text else None


class TurnMemo:
    """Remembered turns per namespace, least recently used dropped: ids never cross a namespace.
    Thread-safe: the server records from its event loop and renders in worker threads."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[tuple[str | None, str], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(
        self, namespace: str | None, content: str | None, calls: Calls, ids: Sequence[int]
    ) -> None:
        key = (namespace, turn_key(content, calls))
        with self._lock:
            self._ids[key] = tuple(ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def recall(
        self, namespace: str | None, content: str | None, calls: Calls
    ) -> tuple[int, ...] | None:
        key = (namespace, turn_key(content, calls))
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
            return ids

    def __len__(self) -> int:
        return len(self._ids)


def _arguments_key(arguments: str) -> list[Any]:
    """Parsed JSON in canonical form, or the text itself (tagged, so the two never collide)."""
    try:
        value = json.loads(arguments, object_pairs_hook=_no_repeated_keys)
    except (ValueError, RecursionError):
        return ["text", arguments]
    return ["json", canonical_json(value)]


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # {"a": 1, "a": 2}: no single meaning to compare
        raise ValueError("a key is repeated")
    return out
