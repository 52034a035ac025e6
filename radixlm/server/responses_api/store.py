"""Stored responses (`store: true`), per cache namespace and bounded, for `previous_response_id`.

A stored response is the conversation it ends (every message but the instructions, its own
output last) and the assistant turns whose generated ids its prompt and output hold. Continuing
it renders that conversation plus the new input with those turns spliced in, so the new prompt
begins with exactly the ids the tree already holds for it: nothing is computed again.

Rules:
- A response lives in the namespace of the request that made it (what `--salt-from` derives,
  subdivided by `cache_salt`) and is found only from there: another tenant's id is unknown, the
  same lookup as an id never issued, so the answer (404) and its time are the same.
- At most `max_per_namespace` responses per namespace, least recently used dropped first, and
  `max_bytes` in all; past that, the namespace holding the most bytes gives up its least
  recently used, so one tenant filling the store evicts its own responses before anyone's.
- Thread-safe (one lock): the event loop stores and looks up.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from radixlm.agents.turns import Turn

Namespace = str | None


@dataclass(frozen=True)
class StoredResponse:
    id: str
    conversation: tuple[dict[str, Any], ...]  # OpenAI chat messages, the output's last
    turns: tuple[Turn, ...]  # generated ids of the conversation's assistant turns
    response: dict[str, Any]  # the response object, as it was answered

    @functools.cached_property
    def num_bytes(self) -> int:
        """What holding it costs, about: its text as JSON and 8 bytes per token id."""
        text = json.dumps([self.conversation, self.response], default=str)
        return len(text) + 8 * sum(len(t.ids) for t in self.turns) + 256


class ResponseStore:
    """The stored responses of one server (see the module docstring)."""

    def __init__(self, max_per_namespace: int, max_bytes: int) -> None:
        self.max_per_namespace = max_per_namespace
        self.max_bytes = max_bytes
        self._spaces: dict[Namespace, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[Namespace, int] = {}  # per namespace
        self._total = 0
        self._lock = threading.Lock()

    def put(self, namespace: Namespace, stored: StoredResponse) -> bool:
        """Store `stored` in `namespace`; False when it alone is larger than the whole store."""
        size = stored.num_bytes
        if size > self.max_bytes:
            return False
        with self._lock:
            space = self._spaces.setdefault(namespace, OrderedDict())
            old = space.pop(stored.id, None)
            if old is not None:
                self._forget(namespace, old)
                space = self._spaces.setdefault(namespace, OrderedDict())
            space[stored.id] = stored
            self._bytes[namespace] = self._bytes.get(namespace, 0) + size
            self._total += size
            while len(space) > self.max_per_namespace:
                self._drop_oldest(namespace)
            while self._total > self.max_bytes:
                self._drop_oldest(max(self._bytes, key=self._bytes.__getitem__))
        return True

    def get(self, namespace: Namespace, response_id: str) -> StoredResponse | None:
        """The response `response_id` of `namespace`, or None (unknown here, whoever made it)."""
        with self._lock:
            space = self._spaces.get(namespace)
            stored = space.get(response_id) if space is not None else None
            if stored is not None and space is not None:
                space.move_to_end(response_id)
            return stored

    def delete(self, namespace: Namespace, response_id: str) -> bool:
        with self._lock:
            space = self._spaces.get(namespace)
            stored = space.pop(response_id, None) if space is not None else None
            if stored is None:
                return False
            self._forget(namespace, stored)
            return True

    def __len__(self) -> int:
        with self._lock:
            return sum(len(space) for space in self._spaces.values())

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._total

    # ---- helpers (under the lock) -------------------------------------------------------------
    def _drop_oldest(self, namespace: Namespace) -> None:
        _, stored = self._spaces[namespace].popitem(last=False)
        self._forget(namespace, stored)

    def _forget(self, namespace: Namespace, stored: StoredResponse) -> None:
        self._bytes[namespace] -= stored.num_bytes
        self._total -= stored.num_bytes
        if not self._spaces[namespace]:
            del self._spaces[namespace], self._bytes[namespace]
