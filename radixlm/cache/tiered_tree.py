"""The radix tree with an L2 tier: a node owns RAM slots (L1), disk pages (L2), or both.

Pages are runs of PAGE_TOKENS tokens at fixed positions of a sequence (page p holds tokens
[64p, 64p + 64)), and a node holds either no pages or every page that ends inside its edge. A
leaf (no child on either tier) whose end is not on a page boundary may also hold a *tail page*:
the partial page from its last boundary to its end, so that a conversation's next turn loads
everything its last turn computed (a finished request's path ends wherever its output did):

    tokens  0 .......... 64 .......... 128 .......... 192 .......... 256
    nodes   [ sys 0..100: L1 ][ turn 1 100..192: L1 + L2 ][ turn 2 192..256: L2 only ]
    pages     none (no copy)    pages 1, 2 (page 1 holds       page 3
                                sys's tokens 64..100 too)

Moving between tiers:
- L1 evicts a leaf (no child in RAM): its slots are freed and, when it is worth keeping (the
  store's admission, or L2 children that would be unreachable without it), its pages are
  written first and it moves to its parent's `l2_children`. A tail no page covers is cut off.
- `match_tiers` walks L1 as `match` does, then continues through `l2_children` and ends the
  continuation on a page boundary, or at the end of a leaf that holds its tail page; `promote`
  gives the loaded nodes their new slots.
- An insert that runs into an L2 node claims it with the inserted slots (its pages stay). A
  node that gains a child gives up its tail page (the child's first page is that page, whole).
- L2 evicts leaf-first (no child with pages) in LRU order from a lazy heap, an L2-only node
  aged from when it left RAM: an L1+L2 node drops its copy; an L2-only leaf gives up its last
  pages (chains shrink from their ends).

Invariants (`check_l2` in cache/integrity.py): besides those of RadixTree, a node without slots
holds pages, no lock and only L2 children, and ends on a page boundary, holds its tail page, or
has a child (whose first page holds its tail); only a node without children holds a tail page;
RAM nodes form a subtree at each root; the L2 order holds exactly
the unpinned nodes with pages and no child with pages; the page counter is the pages held.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from radixlm.cache.eviction import L2Order
from radixlm.cache.radix_tree import MatchResult, RadixTree
from radixlm.cache.tree_node import NO_SLOTS, TOKEN_BYTES, Namespace, TokenIds, TreeNode

PAGE_TOKENS = 64


class PageStore(Protocol):
    """Where a TieredTree's pages live (cache/tiered_cache.py)."""

    def admits(self, node: TreeNode) -> bool:
        """Whether `node` is worth writing to L2 (likely to be asked for again)."""

    @property
    def num_free_pages(self) -> int: ...

    def write_node(self, node: TreeNode, first: int, count: int, staged: bool) -> np.ndarray:
        """Write pages first .. first+count-1 of `node`'s path into free pages; the page ids
        of the leading ones written (fewer when L2 has too few free pages). Not `staged`: the
        KV is copied now (the slots are freed next). `staged`: the KV is copied on the I/O
        thread, and the tree calls `settle(node)` before it frees a slot of the node."""

    def settle(self, node: TreeNode) -> None:
        """`node`, holding pages, leaves RAM: finish copying its staged pages' KV out of its
        slots (or copy it now) before they are freed."""

    def free_pages(self, pages: np.ndarray) -> None:
        """Give pages back once no node holds them."""

    def abort_load(self, node: TreeNode) -> None:
        """An insert reached `node` while a load was reading it: end that load, unpinned."""


class TierMatch(NamedTuple):
    l1: MatchResult  # the prefix in RAM, as RadixTree.match returns it
    chain: tuple[TreeNode, ...]  # the L2-only nodes that continue it, down to `end`
    end: int  # where the continuation ends (a page boundary or a tail page's end); l1.length
    # when there is none
    busy: TreeNode | None = None  # the continuation runs into a node a load is reading


class TieredTree(RadixTree):
    """A RadixTree whose evicted nodes may stay on L2 pages (see the module docstring)."""

    def __init__(self, store: PageStore, page_size: int = 1, policy: str = "lru") -> None:
        if PAGE_TOKENS % page_size:
            raise ValueError(f"page_size {page_size} does not divide the L2 page")
        super().__init__(page_size=page_size, policy=policy)
        self.store = store
        self.l2_order = L2Order()
        self.num_l2_nodes = 0  # nodes held on L2 only
        self.num_l2_pages = 0  # pages held by nodes
        self.l2_evicted_pages = 0
        self.l2_rejected_tokens = 0  # left RAM without being worth a write

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

    def pin(self, chain: tuple[TreeNode, ...], pinned: bool) -> None:
        """Keep a chain out of L2 eviction, splits and claims while a load reads it."""
        for node in chain:
            node.l2_pinned = pinned
            if pinned and node.l2_seq:
                self.l2_order.discard(node)
            elif not pinned:
                self._maybe_l2_leaf(node)

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
        self._make_room(path[-1], sum(_num_pages(n) + _wants_tail(n) for n in todo))
        written, pageless = 0, list[TreeNode]()
        for n in todo:
            full = _num_pages(n)
            count = full + _wants_tail(n)
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
        count = last - first + _wants_tail(node)
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

    def _add_leaf(
        self, parent: TreeNode, key: bytes, slots: np.ndarray, tick: int, turn: int
    ) -> TreeNode:
        if _has_tail(parent):  # the new child's first page is the tail page, whole
            self._drop_tail(parent)
        return super()._add_leaf(parent, key, slots, tick, turn)

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        start, on_l2 = child.start, len(child.value) == 0
        upper = super()._split(child, k)
        if child.pages is not None:  # each part keeps the pages ending in it (the tail: below)
            n = (start + k) // PAGE_TOKENS - start // PAGE_TOKENS
            upper.pages, child.pages = child.pages[:n], child.pages[n:]
            upper.l2_kids = 1
        if on_l2:
            self.num_nodes -= 1
            self.num_l2_nodes += 1
        return upper

    # -- L2 eviction: leaf-first, least recently used ---------------------------------------

    def evict_l2(self, num_pages: int) -> int:
        """Free at least `num_pages` pages if that many are evictable; returns pages freed."""
        freed = 0
        while freed < num_pages and self.l2_order.num_members:
            node = self.l2_order.pop()
            pages = node.pages
            assert pages is not None
            if len(node.value):  # RAM keeps the KV: just drop the copy
                freed += len(pages)
                self._set_pages(node, None)
            elif len(pages) > num_pages - freed:  # give up only the last pages needed
                keep = len(pages) - (num_pages - freed)
                freed += len(pages) - keep
                self.store.free_pages(pages[keep:])
                self.num_l2_pages -= len(pages) - keep
                node.pages = pages[:keep]
                self._cut(node, (node.start // PAGE_TOKENS + keep) * PAGE_TOKENS)
                self.l2_order.add(node)
            else:
                freed += len(pages)
                self.drop_l2(node)
        self.l2_evicted_pages += freed
        return freed

    def drop_l2(self, node: TreeNode) -> None:
        """Forget an L2-only node and everything below it (doubtful, or unreachable)."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.l2_children.values())
            if n.pages is not None:
                self.store.free_pages(n.pages)
                self.num_l2_pages -= len(n.pages)
            if n.l2_seq:
                self.l2_order.discard(n)
            n.depth = -1
            self.num_l2_nodes -= 1
        parent = node.parent
        assert parent is not None
        del parent.l2_children[node.key[: self._page_bytes]]
        parent.l2_kids -= 1
        self._l2_child_gone(parent)

    def flush_l2(self) -> int:
        """Evict every unpinned page; returns how many."""
        return self.evict_l2(self.num_l2_pages)

    # -- helpers ------------------------------------------------------------------------------

    def _make_room(self, node: TreeNode, num_pages: int) -> None:
        """Free pages for `num_pages` of the path down to `node`, never the pages that path
        holds already: a chain's end is worth nothing without its head."""
        if num_pages <= self.store.num_free_pages:
            return
        held: list[TreeNode] = []
        while node.parent is not None:
            if node.pages is not None and not node.l2_pinned:
                held.append(node)
            node = node.parent
        self.pin(tuple(held), True)
        self.evict_l2(num_pages - self.store.num_free_pages)
        self.pin(tuple(held), False)

    def _set_pages(self, node: TreeNode, pages: np.ndarray | None) -> None:
        parent = node.parent
        assert parent is not None
        if node.pages is not None:
            self.store.free_pages(node.pages)
            self.num_l2_pages -= len(node.pages)
            parent.l2_kids -= 1
            if node.l2_seq:
                self.l2_order.discard(node)
        node.pages = pages
        if pages is not None:
            self.num_l2_pages += len(pages)
            parent.l2_kids += 1
            if parent.l2_seq:
                self.l2_order.discard(parent)
            self._maybe_l2_leaf(node)
        else:
            self._maybe_l2_leaf(parent)

    def _settle(self, node: TreeNode) -> None:
        """An L2-only node without children keeps no tail beyond its last page, unless it
        holds that tail's page."""
        if node.l2_children or node.l2_pinned or not node.depth % PAGE_TOKENS or _has_tail(node):
            self._maybe_l2_leaf(node)
            return
        cut = node.depth // PAGE_TOKENS * PAGE_TOKENS
        if cut <= node.start:
            self.drop_l2(node)  # holds no page of its own: its tokens were in a child's
        else:
            self._cut(node, cut)
            self._maybe_l2_leaf(node)

    def _l2_child_gone(self, parent: TreeNode) -> None:
        if parent.parent is None:  # a root
            if not parent.children and not parent.l2_children and parent.namespace is not None:
                del self._roots[parent.namespace]
        elif len(parent.value) == 0:
            self._settle(parent)
        else:
            self._maybe_l2_leaf(parent)

    def _drop_tail(self, node: TreeNode) -> None:
        """`node` gains a child: free its tail page (the child's first page holds those tokens
        and more; two pages at one position would break a chain's page order)."""
        pages = node.pages
        assert pages is not None
        if len(pages) == 1:
            self._set_pages(node, None)
            return
        self.store.free_pages(pages[-1:])
        self.num_l2_pages -= 1
        node.pages = pages[:-1]

    def _cut(self, node: TreeNode, end: int) -> None:
        """Shorten the edge of a node without RAM children so that it ends at `end`."""
        node.key = node.key[: (end - node.start) * TOKEN_BYTES]
        node.value = node.value[: end - node.start] if len(node.value) else NO_SLOTS
        node.depth = end

    def _maybe_l2_leaf(self, node: TreeNode) -> None:
        if node.pages is not None and not node.l2_kids and not node.l2_pinned and not node.l2_seq:
            self.l2_order.add(node)

    def check_integrity(self) -> None:
        super().check_integrity()
        from radixlm.cache.integrity import check_l2

        check_l2(self)


def _num_pages(node: TreeNode) -> int:
    """The L2 pages that end inside `node`'s edge."""
    return node.depth // PAGE_TOKENS - node.start // PAGE_TOKENS


def _wants_tail(node: TreeNode) -> bool:
    """Whether a write of `node` includes its tail page: a leaf ending inside a page."""
    return bool(node.depth % PAGE_TOKENS) and not node.children and not node.l2_children


def _has_tail(node: TreeNode) -> bool:
    return node.pages is not None and len(node.pages) > _num_pages(node)


def _continuation_end(reached: int, last: TreeNode | None) -> int:
    """Where an L2 continuation that reached token `reached` ends: the end of `last` (the
    deepest node passed whole) when it holds its tail page, else the last page boundary."""
    if last is not None and reached == last.depth and _has_tail(last):
        return reached
    return reached // PAGE_TOKENS * PAGE_TOKENS
