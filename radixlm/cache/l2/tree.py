"""The radix tree with a disk tier: a node owns RAM slots (L1), disk extents (L2), or both.

Which extents a node holds (every extent ending in its edge, a leaf's tail extent) is the rule of
cache/l2/node.py; the extents themselves live in an `ExtentStore` (cache/l2/store.py), the only
thing this tree calls. It extends RadixTree through its hooks:
- `_leave_ram`: L1 evicts a leaf (no child in RAM): its slots are freed and, when it is kept
  (the store's pressure rule, `pressure_wants`: free room, or the write filter once L2 is
  full; or L2 children that would be unreachable without it), its extents are written first and
  it moves to its parent's `l2.children`. A tail no extent covers is cut off. A node written
  through already only settles its staged extents.
- `_below_ram`: an insert that runs into L2 nodes claims them with the inserted slots (their
  extents stay); a node about to gain a child gives up its tail extent (the child's first extent
  holds those tokens, whole). The caller ends any load reading those nodes first
  (`loads_in_way`).
- `_split`: each part keeps the extents ending in it; an L2-only node's parts stay on L2.
And on its own:
- `write_through`: a finished request's path gets its extents at once, so that RAM evicting it
  later only drops its slots.
- `match_tiers` walks L1 as `match` does, then continues through `l2.children` and ends the
  continuation on an extent boundary, or at the end of a leaf that holds its tail extent;
  `promote` gives the loaded nodes their new slots.
- L2 evicts leaf-first (no child with extents) in LRU order, an L2-only node aged from when it
  left RAM: an L1+L2 node drops its copy; an L2-only leaf gives up its last extents (chains
  shrink from their ends). A pinned node (a load reads it) stays.

Invariants: RadixTree's, and `check_l2`'s (cache/l2/node.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from radixlm.cache.eviction import EvictionPolicy
from radixlm.cache.l2.node import (
    EXTENT_TOKENS,
    L2Order,
    check_l2,
    continuation_end,
    cut_edge,
    extents_ending_in,
    extents_of,
    has_tail_extent,
    l2_children,
    l2_of,
    wants_tail_extent,
)
from radixlm.cache.l2.store import ExtentStore, pressure_wants
from radixlm.cache.radix_tree import RadixTree
from radixlm.cache.tree_node import (
    NO_SLOTS,
    TOKEN_BYTES,
    MatchResult,
    Namespace,
    TokenIds,
    TreeNode,
)

__all__ = ["EXTENT_TOKENS", "TierMatch", "TieredTree"]


class TierMatch(NamedTuple):
    l1: MatchResult  # the prefix in RAM, as RadixTree.match returns it
    chain: tuple[TreeNode, ...]  # the L2-only nodes that continue it, down to `end`
    end: int  # where the continuation ends (an extent boundary or a tail extent's end); l1.length
    # when there is none
    busy: TreeNode | None = None  # the continuation runs into a node a load is reading


class TieredTree(RadixTree):
    """A RadixTree whose evicted nodes stay on L2 extents and come back from them."""

    def __init__(
        self, store: ExtentStore, page_size: int = 1, policy: str | EvictionPolicy = "lru"
    ) -> None:
        if EXTENT_TOKENS % page_size:
            raise ValueError(f"page_size {page_size} does not divide the L2 extent")
        super().__init__(page_size=page_size, policy=policy)
        self.store = store
        self.l2_order = L2Order()
        self.num_l2_nodes = 0  # nodes held on L2 only
        self.num_l2_extents = 0  # extents held by nodes
        self.l2_evicted_extents = 0
        self.l2_rejected_tokens = 0  # left RAM unwritten (L2 full, the filter refused; RAM_ONLY)

    # -- match: the RAM prefix and its L2 continuation --------------------------------------

    def match_tiers(self, tokens: TokenIds, namespace: Namespace = None) -> TierMatch:
        """`match`, then the L2 nodes that continue it, ending on an extent boundary (the last
        one split there) or at the end of a tail extent; it stops at a node a load is reading.
        Touches them (L2 LRU). Pin the chain before anything can evict L2."""
        ids = np.asarray(tokens, dtype=np.int64)
        m = self.match(ids, namespace)
        node = m.node
        if not l2_children(node):
            return TierMatch(m, (), m.length)
        buf, page_b = self._page_bytes_of(ids), self._page_bytes
        pos, chain = m.length * TOKEN_BYTES, list[TreeNode]()
        while pos < len(buf):
            child = l2_children(node).get(buf[pos : pos + page_b])
            if child is None:
                break
            if l2_of(child).pinned:  # being loaded for another request: never split it
                if not chain:
                    return TierMatch(m, (), m.length, child)
                break
            chain.append(child)
            if not buf.startswith(child.key, pos):
                pos += self._common_len(child.key, buf, pos) * TOKEN_BYTES
                break
            pos += len(child.key)
            node = child
        end = continuation_end(pos // TOKEN_BYTES, chain[-1] if chain else None)
        chain = [c for c in chain if c.start < end]
        if not chain:
            return TierMatch(m, (), m.length)
        if chain[-1].depth > end:
            chain[-1] = self._split(chain[-1], end - chain[-1].start)
        for c in chain:
            c.last_access = self._clock
        return TierMatch(m, tuple(chain), end)

    def peek_tiers(self, tokens: TokenIds, namespace: Namespace = None) -> int:
        """The length `match_tiers` would end at (the RAM prefix, or its L2 continuation),
        changing nothing. A chain another load is reading counts too: a request that runs
        into it waits for that load and computes none of it."""
        buf = self._page_bytes_of(np.asarray(tokens, dtype=np.int64))
        node, length = self._peek(buf, namespace)
        if node is None:
            return length
        pos, last = self._l2_walk(node, buf, length * TOKEN_BYTES)
        return max(length, continuation_end(pos // TOKEN_BYTES, last))

    def loads_in_way(self, tokens: TokenIds, namespace: Namespace = None) -> list[TreeNode]:
        """The pinned L2 nodes an insert of `tokens` would claim (their loads must end first)."""
        buf = self._page_bytes_of(np.asarray(tokens, dtype=np.int64))
        node, length = self._peek(buf, namespace)
        if node is None:
            return []
        pinned, pos, page_b = [], length * TOKEN_BYTES, self._page_bytes
        while pos < len(buf):
            child = l2_children(node).get(buf[pos : pos + page_b])
            if child is None:
                break
            if l2_of(child).pinned:
                pinned.append(child)
            pos += len(child.key)
            node = child
        return pinned

    def promote(self, match: TierMatch, end: int, slots: np.ndarray) -> MatchResult:
        """The loaded chain of `match` up to `end` (slots for tokens l1.length .. end, their
        KV already copied in) becomes tree-owned: those nodes join L1. Returns the lengthened
        match."""
        m = match.l1
        node, tick = m.node, self._clock
        for c in match.chain:
            if c.start >= end:
                break
            if c.depth > end:
                c = self._split(c, end - c.start)
            self._promote(c, slots[c.start - m.length : c.depth - m.length], tick)
            node = c
        return MatchResult(end, np.concatenate([m.slots, slots]), node)

    # -- writing: through at finish, or as a node leaves RAM ----------------------------------

    def write_through(self, node: TreeNode) -> int:
        """A request ending at `node` finished: give the path down to its deepest node worth
        keeping (by the store's pressure rule, or already holding extents) the extents it lacks now,
        copied off the engine thread, so that RAM evicting them later frees their slots and
        writes nothing. Where L2 runs out the node is split after its last written extent (a
        node in RAM is never cut) and the write ends. Returns the extents written. The caller
        holds a lock on `node`."""
        path: list[TreeNode] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        missing = sum(_num_to_write(n) for n in path if extents_of(n) is None)
        keep = [
            i
            for i, n in enumerate(path)
            if extents_of(n) is not None or pressure_wants(self.store, n, self.turns, missing)
        ]
        todo = [n for n in path[: keep[-1] + 1] if extents_of(n) is None] if keep else []
        if not todo:
            return 0
        self._make_room(path[-1], sum(extents_ending_in(n) + wants_tail_extent(n) for n in todo))
        written, extentless = 0, list[TreeNode]()
        for n in todo:
            full = extents_ending_in(n)
            count = full + wants_tail_extent(n)
            if count == 0:  # no extent ends here: the first extent written below holds its tokens
                extentless.append(n)
                continue
            extents = self.store.write_node(n, n.start // EXTENT_TOKENS, count, staged=True)
            if not len(extents):
                break
            if len(extents) < full:  # L2 is full: the written head becomes a node of its own
                cut = (n.start // EXTENT_TOKENS + len(extents)) * EXTENT_TOKENS
                n = self._split(n, cut - n.start)
            for p in extentless:
                self._set_extents(p, NO_SLOTS)
            extentless.clear()
            self._set_extents(n, extents)
            written += len(extents)
            if len(extents) < count:
                break
        return written

    def _write(self, node: TreeNode) -> None:
        """Give `node` its extents (those ending in its edge, and its tail extent if it is a
        leaf), cutting it where L2 ran out."""
        first, last = node.start // EXTENT_TOKENS, node.depth // EXTENT_TOKENS
        count = _num_to_write(node)
        if count == 0 and not l2_children(node):
            return  # no extent ends here and nothing below needs this node
        self._make_room(node, count)
        extents = NO_SLOTS
        if count:
            extents = self.store.write_node(node, first, count, staged=False)
        if len(extents) < last - first:
            for child in list(l2_children(node).values()):
                self.drop_l2(child)
            if not len(extents):
                return
            cut_edge(node, (first + len(extents)) * EXTENT_TOKENS)
        self._set_extents(node, extents)

    # -- RadixTree's hooks: leaving and entering RAM, splits ----------------------------------

    def _leave_ram(self, node: TreeNode) -> None:
        if extents_of(node) is not None:
            self.store.settle(node)  # written through: its slots go once their KV is copied
        elif l2_children(node) or pressure_wants(self.store, node, self.turns, _num_to_write(node)):
            self._write(node)
        else:
            self.l2_rejected_tokens += node.num_tokens
        parent = node.parent
        assert parent is not None
        if extents_of(node) is None:
            for child in list(l2_children(node).values()):
                self.drop_l2(child)  # unreachable without this node
            self._unlink(node)
            self._child_left_ram(parent)
            self._forget_if_empty(parent)
            return
        first = node.key[: self._page_bytes]
        del parent.children[first]
        l2_of(parent).children[first] = node
        node.value = NO_SLOTS
        # Its L2 age starts now: RAM's policy decided how long it stayed there, and a copy of
        # a node still in RAM (older, and free to drop) goes before it.
        node.last_access = self._clock
        self.num_nodes -= 1
        self.num_l2_nodes += 1
        self._end_on_extent(node)
        self._child_left_ram(parent)

    def _below_ram(
        self, node: TreeNode, buf: bytes, pos: int, slots: np.ndarray, tick: int
    ) -> tuple[TreeNode, int]:
        page_b = self._page_bytes
        while pos < len(buf):
            child = l2_children(node).get(buf[pos : pos + page_b])
            if child is None:
                break
            if l2_of(child).pinned:
                raise RuntimeError(f"an insert reached {child!r}, which a load is reading")
            if not buf.startswith(child.key, pos):
                child = self._split(child, self._common_len(child.key, buf, pos))
            at = pos // TOKEN_BYTES
            self._promote(child, slots[at : at + child.num_tokens], tick)
            self._inserted_tokens += child.num_tokens
            pos += len(child.key)
            node = child
        if pos < len(buf) and has_tail_extent(node):  # the new leaf's first extent holds the tail
            self._drop_tail(node)
        return node, pos

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        start, on_l2 = child.start, len(child.value) == 0
        upper = super()._split(child, k)
        if on_l2:  # RadixTree filed both parts under `children`: they stay on L2
            parent, page_b = upper.parent, self._page_bytes
            assert parent is not None
            l2_of(parent).children[upper.key[:page_b]] = parent.children.pop(upper.key[:page_b])
            l2_of(upper).children[child.key[:page_b]] = upper.children.pop(child.key[:page_b])
            self.num_nodes -= 1
            self.num_l2_nodes += 1
        extents = extents_of(child)
        if extents is not None:  # each part keeps the extents ending in it (the tail: below)
            n = (start + k) // EXTENT_TOKENS - start // EXTENT_TOKENS
            record = l2_of(upper)
            record.extents, l2_of(child).extents = extents[:n], extents[n:]
            record.kids = 1
        return upper

    def _promote(self, node: TreeNode, slots: np.ndarray, tick: int) -> None:
        """An L2-only node gets RAM slots and joins L1 (an evictable leaf); it keeps its extents."""
        parent = node.parent
        assert parent is not None and len(slots) == node.num_tokens
        first = node.key[: self._page_bytes]
        parent.children[first] = l2_of(parent).children.pop(first)
        value = slots.copy()
        value.setflags(write=False)
        node.value = value
        node.last_access = tick
        self._touch(node, tick)
        if parent.evict_seq:
            self._order.discard(parent)  # it has a child in RAM now
        self._order.add(node)
        self.evictable_tokens += len(value)
        self.num_nodes += 1
        self.num_l2_nodes -= 1

    # -- L2 eviction: leaf-first, least recently used ---------------------------------------

    def pin(self, chain: tuple[TreeNode, ...], pinned: bool) -> None:
        """Keep a chain out of L2 eviction, splits and claims while a load reads it."""
        for node in chain:
            record = l2_of(node)
            record.pinned = pinned
            if pinned and record.seq:
                self.l2_order.discard(node)
            elif not pinned:
                self._maybe_l2_leaf(node)

    def evict_l2(self, num_extents: int) -> int:
        """Free at least `num_extents` extents if that many are evictable; returns extents freed."""
        freed = 0
        while freed < num_extents and self.l2_order.num_members:
            node = self.l2_order.pop()
            extents = extents_of(node)
            assert extents is not None
            if len(node.value):  # RAM keeps the KV: just drop the copy
                freed += len(extents)
                self._set_extents(node, None)
            elif len(extents) > num_extents - freed:  # give up only the last extents needed
                keep = len(extents) - (num_extents - freed)
                freed += len(extents) - keep
                self.store.free_extents(extents[keep:])
                self.num_l2_extents -= len(extents) - keep
                l2_of(node).extents = extents[:keep]
                cut_edge(node, (node.start // EXTENT_TOKENS + keep) * EXTENT_TOKENS)
                self.l2_order.add(node)
            else:
                freed += len(extents)
                self.drop_l2(node)
        self.l2_evicted_extents += freed
        return freed

    def drop_l2(self, node: TreeNode) -> None:
        """Forget an L2-only node and everything below it (doubtful, or unreachable)."""
        stack = [node]
        while stack:
            n = stack.pop()
            record = l2_of(n)
            stack.extend(record.children.values())
            if record.extents is not None:
                self.store.free_extents(record.extents)
                self.num_l2_extents -= len(record.extents)
            if record.seq:
                self.l2_order.discard(n)
            n.depth = -1
            self.num_l2_nodes -= 1
        parent = node.parent
        assert parent is not None
        record = l2_of(parent)
        del record.children[node.key[: self._page_bytes]]
        record.kids -= 1
        self._l2_child_gone(parent)

    def flush_l2(self) -> int:
        """Evict every unpinned extent; returns how many."""
        return self.evict_l2(self.num_l2_extents)

    def check_integrity(self) -> None:
        super().check_integrity()
        check_l2(self)

    # -- helpers ------------------------------------------------------------------------------

    def _l2_walk(self, node: TreeNode, buf: bytes, pos: int) -> tuple[int, TreeNode]:
        """Follow `buf` from byte `pos` down `node`'s L2 children, changing nothing: the byte
        offset reached and the deepest node passed whole."""
        page_b = self._page_bytes
        while pos < len(buf):
            child = l2_children(node).get(buf[pos : pos + page_b])
            if child is None:
                break
            if not buf.startswith(child.key, pos):
                return pos + self._common_len(child.key, buf, pos) * TOKEN_BYTES, node
            pos += len(child.key)
            node = child
        return pos, node

    def _make_room(self, node: TreeNode, num_extents: int) -> None:
        """Free extents for `num_extents` of the path down to `node`, never the extents that path
        holds already: a chain's end is worth nothing without its head."""
        if num_extents <= self.store.num_free_extents:
            return
        held: list[TreeNode] = []
        while node.parent is not None:
            if node.l2 is not None and node.l2.extents is not None and not node.l2.pinned:
                held.append(node)
            node = node.parent
        self.pin(tuple(held), True)
        self.evict_l2(num_extents - self.store.num_free_extents)
        self.pin(tuple(held), False)

    def _set_extents(self, node: TreeNode, extents: np.ndarray | None) -> None:
        parent = node.parent
        assert parent is not None
        record, above = l2_of(node), l2_of(parent)
        if record.extents is not None:
            self.store.free_extents(record.extents)
            self.num_l2_extents -= len(record.extents)
            above.kids -= 1
            if record.seq:
                self.l2_order.discard(node)
        record.extents = extents
        if extents is not None:
            self.num_l2_extents += len(extents)
            above.kids += 1
            if above.seq:
                self.l2_order.discard(parent)
            self._maybe_l2_leaf(node)
        else:
            self._maybe_l2_leaf(parent)

    def _end_on_extent(self, node: TreeNode) -> None:
        """An L2-only node without children keeps no tail beyond its last extent, unless it
        holds that tail's extent."""
        record = l2_of(node)
        keeps = record.children or record.pinned or has_tail_extent(node)
        if keeps or not node.depth % EXTENT_TOKENS:
            self._maybe_l2_leaf(node)
            return
        cut = node.depth // EXTENT_TOKENS * EXTENT_TOKENS
        if cut <= node.start:
            self.drop_l2(node)  # holds no extent of its own: its tokens were in a child's
        else:
            cut_edge(node, cut)
            self._maybe_l2_leaf(node)

    def _l2_child_gone(self, parent: TreeNode) -> None:
        if parent.parent is None:
            self._forget_if_empty(parent)
        elif len(parent.value) == 0:
            self._end_on_extent(parent)
        else:
            self._maybe_l2_leaf(parent)

    def _forget_if_empty(self, node: TreeNode) -> None:
        """Forget a tenant root with no child on either tier."""
        empty = not node.children and not l2_children(node)
        if empty and node.parent is None and node.namespace is not None:
            self._roots.pop(node.namespace, None)

    def _drop_tail(self, node: TreeNode) -> None:
        """`node` gains a child: free its tail extent (the child's first extent holds those
        tokens and more; two extents at one position would break a chain's order)."""
        record = l2_of(node)
        assert record.extents is not None
        if len(record.extents) == 1:
            self._set_extents(node, None)
            return
        self.store.free_extents(record.extents[-1:])
        self.num_l2_extents -= 1
        record.extents = record.extents[:-1]

    def _maybe_l2_leaf(self, node: TreeNode) -> None:
        record = node.l2
        if record is None or record.extents is None or record.kids or record.pinned:
            return
        if not record.seq:
            self.l2_order.add(node)


def _num_to_write(node: TreeNode) -> int:
    """The extents `_write` gives `node`: those ending in its edge, and its tail extent if it is
    a leaf ending inside one."""
    return extents_ending_in(node) + wants_tail_extent(node)
