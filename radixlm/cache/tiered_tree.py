"""The radix tree with an L2 tier: a node owns RAM slots (L1), disk pages (L2), or both.

Which pages a node holds (whole pages ending in its edge, a leaf's tail page) and how L2 evicts
are PagedTree's (cache/paged_tree.py). Moving between tiers:
- L1 evicts a leaf (no child in RAM): its slots are freed and, when it is worth keeping (the
  store's admission, or L2 children that would be unreachable without it), its pages are
  written first and it moves to its parent's `l2_children`. A tail no page covers is cut off.
- A finished request's path is written through at once (`write_through`), so that RAM evicting
  it later only drops its slots.
- `match_tiers` walks L1 as `match` does, then continues through `l2_children` and ends the
  continuation on a page boundary, or at the end of a leaf that holds its tail page; `promote`
  gives the loaded nodes their new slots.
- An insert that runs into an L2 node claims it with the inserted slots (its pages stay).

Invariants (`check_l2` in cache/integrity.py): besides those of RadixTree, a node without slots
holds pages, no lock and only L2 children, and ends on a page boundary, holds its tail page, or
has a child (whose first page holds its tail); only a node without children holds a tail page;
RAM nodes form a subtree at each root; the L2 order holds exactly the unpinned nodes with pages
and no child with pages; the page counter is the pages held.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from radixlm.cache.paged_tree import (
    PAGE_TOKENS,
    PagedTree,
    PageStore,
    has_tail_page,
    pages_ending_in,
    wants_tail_page,
)
from radixlm.cache.radix_tree import MatchResult
from radixlm.cache.tree_node import NO_SLOTS, TOKEN_BYTES, Namespace, TokenIds, TreeNode

__all__ = ["PAGE_TOKENS", "PageStore", "TierMatch", "TieredTree"]


class TierMatch(NamedTuple):
    l1: MatchResult  # the prefix in RAM, as RadixTree.match returns it
    chain: tuple[TreeNode, ...]  # the L2-only nodes that continue it, down to `end`
    end: int  # where the continuation ends (a page boundary or a tail page's end); l1.length
    # when there is none
    busy: TreeNode | None = None  # the continuation runs into a node a load is reading


class TieredTree(PagedTree):
    """A PagedTree whose evicted nodes stay on L2 pages and come back from them."""

    # -- match: the RAM prefix and its L2 continuation --------------------------------------

    def match_tiers(self, tokens: TokenIds, namespace: Namespace = None) -> TierMatch:
        """`match`, then the L2 nodes that continue it, ending on a page boundary (the last one
        split there) or at the end of a tail page; it stops at a node a load is reading.
        Touches them (L2 LRU). Pin the chain before anything can evict L2."""
        ids = np.asarray(tokens, dtype=np.int64)
        m = self.match(ids, namespace)
        node = m.node
        if not node.l2_children:
            return TierMatch(m, (), m.length)
        buf, page_b = self._page_bytes_of(ids), self._page_bytes
        pos, chain = m.length * TOKEN_BYTES, list[TreeNode]()
        while pos < len(buf):
            child = node.l2_children.get(buf[pos : pos + page_b])
            if child is None:
                break
            if child.l2_pinned:  # being loaded for another request: never split it
                if not chain:
                    return TierMatch(m, (), m.length, child)
                break
            chain.append(child)
            if not buf.startswith(child.key, pos):
                pos += self._common_len(child.key, buf, pos) * TOKEN_BYTES
                break
            pos += len(child.key)
            node = child
        end = _continuation_end(pos // TOKEN_BYTES, chain[-1] if chain else None)
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
        changing nothing. A chain another load is reading counts too: a
        request that runs into it waits for that load and computes none of it."""
        buf = self._page_bytes_of(np.asarray(tokens, dtype=np.int64))
        node, length = self._peek(buf, namespace)
        if node is None or not node.l2_children:
            return length
        pos, page_b = length * TOKEN_BYTES, self._page_bytes
        while pos < len(buf):
            child = node.l2_children.get(buf[pos : pos + page_b])
            if child is None:
                break
            if not buf.startswith(child.key, pos):
                pos += self._common_len(child.key, buf, pos) * TOKEN_BYTES
                break
            pos += len(child.key)
            node = child
        return max(length, _continuation_end(pos // TOKEN_BYTES, node))

    @property
    def version(self) -> tuple[int, ...]:
        """Changes whenever a `peek` or `peek_tiers` result may have changed."""
        return (*super().version, self.num_l2_pages, self.l2_evicted_pages)

    def promote(self, match: TierMatch, end: int, slots: np.ndarray) -> MatchResult:
        """The chain's KV up to `end` (a page boundary, or the chain's end) was loaded into
        `slots` (tokens match.l1.length .. end): those nodes join L1. Returns the lengthened
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
        keeping (admitted, or already holding pages) the pages it lacks now, copied off the
        engine thread, so that RAM evicting them later frees their slots and writes nothing.
        Where L2 runs out the node is split after its last written page (a node in RAM is
        never cut) and the write ends. Returns the pages written. The caller holds a lock on
        `node`."""
        path: list[TreeNode] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        keep = [i for i, n in enumerate(path) if n.pages is not None or self.store.admits(n)]
        todo = [n for n in path[: keep[-1] + 1] if n.pages is None] if keep else []
        if not todo:
            return 0
        self._make_room(path[-1], sum(pages_ending_in(n) + wants_tail_page(n) for n in todo))
        written, pageless = 0, list[TreeNode]()
        for n in todo:
            full = pages_ending_in(n)
            count = full + wants_tail_page(n)
            if count == 0:  # no page ends here: the first page written below holds its tokens
                pageless.append(n)
                continue
            pages = self.store.write_node(n, n.start // PAGE_TOKENS, count, staged=True)
            if not len(pages):
                break
            if len(pages) < full:  # L2 is full: the written head becomes a node of its own
                n = self._split(n, (n.start // PAGE_TOKENS + len(pages)) * PAGE_TOKENS - n.start)
            for p in pageless:
                self._set_pages(p, NO_SLOTS)
            pageless.clear()
            self._set_pages(n, pages)
            written += len(pages)
            if len(pages) < count:
                break
        return written

    # -- leaving and entering RAM -------------------------------------------------------------

    def _leave_l1(self, node: TreeNode) -> None:
        if node.pages is not None:
            self.store.settle(node)  # written through: its slots go once their KV is copied
        elif node.l2_children or self.store.admits(node):
            self._write(node)
        else:
            self.l2_rejected_tokens += node.num_tokens
        if node.pages is None:
            for child in list(node.l2_children.values()):
                self.drop_l2(child)  # unreachable without this node
            super()._leave_l1(node)
            return
        parent = node.parent
        assert parent is not None
        first = node.key[: self._page_bytes]
        del parent.children[first]
        parent.l2_children[first] = node
        node.value = NO_SLOTS
        # Its L2 age starts now: RAM's policy decided how long it stayed there, and a copy of
        # a node still in RAM (older, and free to drop) goes before it.
        node.last_access = self._clock
        self.num_nodes -= 1
        self.num_l2_nodes += 1
        self._settle(node)
        self._after_child_left(parent)

    def _write(self, node: TreeNode) -> None:
        """Give `node` its pages (those ending in its edge, and its tail page if it is a leaf),
        cutting it where L2 ran out."""
        first, last = node.start // PAGE_TOKENS, node.depth // PAGE_TOKENS
        count = last - first + wants_tail_page(node)
        if count == 0 and not node.l2_children:
            return  # no page ends here and nothing below needs this node
        self._make_room(node, count)
        pages = NO_SLOTS
        if count:
            pages = self.store.write_node(node, first, count, staged=False)
        if len(pages) < last - first:
            for child in list(node.l2_children.values()):
                self.drop_l2(child)
            if not len(pages):
                return
            self._cut(node, (first + len(pages)) * PAGE_TOKENS)
        self._set_pages(node, pages)

    def _claim_lower_tier(
        self, node: TreeNode, buf: bytes, pos: int, slots: np.ndarray, tick: int
    ) -> tuple[TreeNode, int]:
        page_b = self._page_bytes
        while pos < len(buf):
            child = node.l2_children.get(buf[pos : pos + page_b])
            if child is None:
                break
            if child.l2_pinned:
                self.store.abort_load(child)  # these tokens were computed first: load nothing
            if not buf.startswith(child.key, pos):
                child = self._split(child, self._common_len(child.key, buf, pos))
            at = pos // TOKEN_BYTES
            self._promote(child, slots[at : at + child.num_tokens], tick)
            self._inserted_tokens += child.num_tokens
            pos += len(child.key)
            node = child
        return node, pos

    def _promote(self, node: TreeNode, slots: np.ndarray, tick: int) -> None:
        """An L2-only node gets RAM slots and joins L1 (an evictable leaf); it keeps its pages."""
        parent = node.parent
        assert parent is not None and len(slots) == node.num_tokens
        first = node.key[: self._page_bytes]
        del parent.l2_children[first]
        parent.children[first] = node
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


def _continuation_end(reached: int, last: TreeNode | None) -> int:
    """Where an L2 continuation that reached token `reached` ends: the end of `last` (the
    deepest node passed whole) when it holds its tail page, else the last page boundary."""
    if last is not None and reached == last.depth and has_tail_page(last):
        return reached
    return reached // PAGE_TOKENS * PAGE_TOKENS
