"""A brute-force model of the radix tree for the property tests: every cached page-aligned
prefix is a dict entry, so nothing about edges, splits or heaps can be wrong in it.

The only structure it keeps is the set of prefixes where a node ends, because LRU follows
SGLang: when a walk stops inside an edge, the part of the edge below the stop counts as
touched too."""

from __future__ import annotations

from collections.abc import Sequence

Key = tuple[str | None, tuple[int, ...]]  # (namespace, token prefix ending on a page boundary)


class ReferenceCache:
    """Per (namespace, prefix of i whole pages): the slots of page i and its last access."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.slots: dict[Key, tuple[int, ...]] = {}
        self.access: dict[Key, int] = {}
        self.locked: list[Key] = []  # the sequence end of every lock held (with repeats)
        self.ends: set[Key] = set()  # prefixes where a tree node ends
        self.clock = 0

    @property
    def num_tokens(self) -> int:
        return len(self.slots) * self.page_size

    def match(self, tokens: Sequence[int], namespace: str | None) -> tuple[int, list[int]]:
        self.clock += 1
        found: list[int] = []
        for key in self._page_keys(tokens, namespace):
            if key not in self.slots:
                break
            self.access[key] = self.clock
            found.extend(self.slots[key])
        self._walk_stops(namespace, tuple(tokens[: len(found)]))
        return len(found), found

    def insert(self, tokens: Sequence[int], slots: Sequence[int], namespace: str | None) -> int:
        self.clock += 1
        prefix_len, missing = 0, False
        for key in self._page_keys(tokens, namespace):
            end = len(key[1])
            if key not in self.slots:
                missing = True
                self.slots[key] = tuple(slots[end - self.page_size : end])
            elif not missing:
                prefix_len = end
            self.access[key] = self.clock
        self._walk_stops(namespace, tuple(tokens[:prefix_len]))
        end = len(tokens) // self.page_size * self.page_size
        if end:
            self.ends.add((namespace, tuple(tokens[:end])))
        return prefix_len

    def protected(self) -> set[Key]:
        p = self.page_size
        return {(ns, seq[:i]) for ns, seq in self.locked for i in range(p, len(seq) + 1, p)}

    def leaves(self) -> set[Key]:
        """Cached prefixes that no cached prefix extends."""
        parents = {(ns, seq[: -self.page_size]) for ns, seq in self.slots}
        return set(self.slots) - parents

    def remove_slots(self, freed: set[int]) -> list[Key]:
        gone = [key for key, slots in self.slots.items() if freed.intersection(slots)]
        for key in gone:
            assert freed.issuperset(self.slots.pop(key)), "a page was evicted in part"
            del self.access[key]
            self.ends.discard(key)
        return gone

    def _walk_stops(self, namespace: str | None, prefix: tuple[int, ...]) -> None:
        """A walk stopped at `prefix`: inside an edge, the tree splits it there and the edge's
        lower part (down to the next node end) is touched."""
        stop = (namespace, prefix)
        if not prefix or stop in self.ends:
            return
        self.ends.add(stop)
        key = stop
        while True:
            key = next(k for k in self.slots if k[0] == namespace and k[1][: len(key[1])] == key[1]
                       and len(k[1]) == len(key[1]) + self.page_size)  # fmt: skip
            self.access[key] = self.clock
            if key in self.ends:
                return

    def _page_keys(self, tokens: Sequence[int], namespace: str | None) -> list[Key]:
        ends = range(self.page_size, len(tokens) + 1, self.page_size)
        return [(namespace, tuple(tokens[:end])) for end in ends]
