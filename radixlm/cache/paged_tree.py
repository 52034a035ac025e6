"""A radix tree whose nodes may hold L2 pages: which pages a node holds, and L2 eviction.

Pages are runs of PAGE_TOKENS tokens at fixed positions of a sequence (page p holds tokens
[64p, 64p + 64)), and a node holds either no pages or every page that ends inside its edge. A
leaf (no child on either tier) whose end is not on a page boundary may also hold a *tail page*:
the partial page from its last boundary to its end, so that a conversation's next turn loads
everything its last turn computed (a finished request's path ends wherever its output did):

    tokens  0 .......... 64 .......... 128 .......... 192 .......... 256
    nodes   [ sys 0..100: L1 ][ turn 1 100..192: L1 + L2 ][ turn 2 192..256: L2 only ]
    pages     none (no copy)    pages 1, 2 (page 1 holds       page 3
                                sys's tokens 64..100 too)

- A split gives each part the pages ending in it; a node that gains a child gives up its tail
  page (the child's first page is that page, whole).
- L2 evicts leaf-first (no child with pages) in LRU order from a lazy heap, an L2-only node
  aged from when it left RAM: an L1+L2 node drops its copy; an L2-only leaf gives up its last
  pages (chains shrink from their ends). A pinned node (a load reads it) stays.

How nodes move between the tiers is TieredTree's (cache/tiered_tree.py); the pages themselves
live in a PageStore (cache/tiered_cache.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from radixlm.cache.eviction import L2Order
from radixlm.cache.radix_tree import RadixTree
from radixlm.cache.tree_node import NO_SLOTS, TOKEN_BYTES, TreeNode

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


class PagedTree(RadixTree):
    """A RadixTree whose nodes may hold L2 pages (see the module docstring)."""

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

    def pin(self, chain: tuple[TreeNode, ...], pinned: bool) -> None:
        """Keep a chain out of L2 eviction, splits and claims while a load reads it."""
        for node in chain:
            node.l2_pinned = pinned
            if pinned and node.l2_seq:
                self.l2_order.discard(node)
            elif not pinned:
                self._maybe_l2_leaf(node)

    def _add_leaf(
        self, parent: TreeNode, key: bytes, slots: np.ndarray, tick: int, turn: int
    ) -> TreeNode:
        if has_tail_page(parent):  # the new child's first page is the tail page, whole
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
        keeps = node.l2_children or node.l2_pinned or has_tail_page(node)
        if keeps or not node.depth % PAGE_TOKENS:
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


def pages_ending_in(node: TreeNode) -> int:
    """The L2 pages that end inside `node`'s edge."""
    return node.depth // PAGE_TOKENS - node.start // PAGE_TOKENS


def wants_tail_page(node: TreeNode) -> bool:
    """Whether a write of `node` includes its tail page: a leaf ending inside a page."""
    return bool(node.depth % PAGE_TOKENS) and not node.children and not node.l2_children


def has_tail_page(node: TreeNode) -> bool:
    return node.pages is not None and len(node.pages) > pages_ending_in(node)
