"""RadixCache with an L2 tier of KV pages on disk (first version: loads inside `match`).

L1 is the radix tree over the slot pool. When L1 evicts a node worth keeping (admission: a
hit, a conversation's second turn or later, or a first turn once enough of them measurably
came back; cache/turns.py), the whole 64-token pages that end inside its span are copied out of
the pool on the engine thread and written to the page file (cache/l2_pages.py) by its I/O
threads; the copy is taken before the slots are freed, so a write never reads reused slots.

    tokens   |0 ........ 64 ........ 128 ........ 192 ...|
    pages    [  page 0  ][  page 1  ][  page 2   ]           key_i = H(key_{i-1}, page i tokens)
    L1 match |=========== 100 ====|                          L2 continuation: pages 1, 2
    loaded                        |==== 100..192 ====|       -> new slots, then tree-owned

`match` finds the L1 prefix, then the run of pages that continues it (chained keys name every
token before them, and the namespace), reads them in parallel, writes their KV into freshly
allocated slots and inserts those into the tree, so the caller sees one longer L1 prefix. A
page that fails its key or checksum ends the run there: the rest is recomputed, never loaded
wrong. L2 forgets its least recently used page when full (a chain then stops earlier).

Accounting: slots as RadixCache (free + tree + in flight == capacity); pages: free pages +
indexed pages == num_pages (check_integrity checks both).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np
import torch

from radixlm.cache.kv_pool import KVPool, OutOfSlotsError
from radixlm.cache.l2_pages import L2Error, L2PageFile, page_key
from radixlm.cache.prefix_cache import RadixCache
from radixlm.cache.radix_tree import MatchResult, Namespace, TreeNode
from radixlm.cache.tree_node import TokenIds
from radixlm.cache.turns import TurnTracker
from radixlm.config import CacheConfig

log = logging.getLogger(__name__)

PAGE_TOKENS = 64
ADMIT_RATE = 0.25  # a first turn is written once this share of first turns came back


class TieredRadixCache(RadixCache):
    """A RadixCache whose evictions spill to, and whose matches load from, an L2 page file."""

    def __init__(
        self, pool: KVPool, l2: L2PageFile, page_size: int = 1, policy: str = "lru"
    ) -> None:
        super().__init__(pool, page_size=page_size, policy=policy)
        self.kv = pool
        self.l2 = l2
        # chained page key -> (page id, its pending write, the key before it); oldest first
        self._index: OrderedDict[bytes, tuple[int, Future[None], bytes | None]] = OrderedDict()
        self._successors: dict[bytes, int] = {}  # key -> indexed pages that continue it
        self._fingerprint = _fingerprint(pool)
        self.l2_hit_tokens = self.l2_written_pages = self.l2_read_pages = 0
        self.l2_rejected_tokens = self.l2_bad_pages = 0

    # -- L1 eviction spills to L2 ------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        tree, chained = self.tree, self.tree.eviction_listener
        namespaces: dict[int, Namespace] = {}

        def spill(node: TreeNode) -> None:
            self._spill(node, namespaces)
            if chained is not None:
                chained(node)

        tree.eviction_listener = spill
        try:
            return super().evict(num_tokens)
        finally:
            tree.eviction_listener = chained

    def _spill(self, node: TreeNode, namespaces: dict[int, Namespace]) -> None:
        if not _admits(node, self.tree.turns):
            self.l2_rejected_tokens += len(node.value)
            return
        start, end = node.depth - len(node.value), node.depth
        first, last = start // PAGE_TOKENS, end // PAGE_TOKENS  # the pages ending in (start, end]
        if last <= first:
            return
        tokens, slots, namespace = self._path(node)
        keys = _chain(self._fingerprint, namespace, tokens, last)
        chain = set(keys)
        for p in range(first, last):
            if keys[p] in self._index:
                self._index.move_to_end(keys[p])
                continue
            page = self._alloc_page(chain)
            if page is None:
                return  # full of this chain's own pages: the head is worth more than the tail
            payload = self._gather(slots[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS])
            prev = keys[p - 1] if p else None
            self._index[keys[p]] = (page, self.l2.write(page, keys[p], payload), prev)
            if prev is not None:
                self._successors[prev] = self._successors.get(prev, 0) + 1
            self.l2_written_pages += 1

    def _alloc_page(self, keep: set[bytes]) -> int | None:
        """A free page, forgetting the least recently used *leaf* page when L2 is full: a page
        that an indexed page continues waits for it, so chains shrink from their ends. Pages
        in `keep` (the chain being written) are never forgotten; None if only they are left."""
        page = self.l2.alloc()
        while page is None:
            leaves = (k for k in self._index if not self._successors.get(k) and k not in keep)
            victim = next(leaves, None)
            if victim is None:
                return None
            self._forget(victim)
            page = self.l2.alloc()
        return page

    def _forget(self, key: bytes) -> None:
        page, pending, prev = self._index.pop(key)
        _wait(pending)  # the page is reused only once its last write is done
        self.l2.free(page)
        if prev is not None and prev in self._successors:
            self._successors[prev] -= 1
            if not self._successors[prev]:
                del self._successors[prev]

    # -- matching continues into L2 ----------------------------------------------------------

    def match(self, tokens: TokenIds, namespace: Namespace = None) -> MatchResult:
        """The L1 prefix, lengthened by what L2 holds after it (loaded into tree-owned slots).
        Unlike RadixCache.match this may allocate slots and hand them to the tree."""
        m = self.tree.match(tokens, namespace)
        ids = np.asarray(tokens, dtype=np.int64)
        num_pages = len(ids) // PAGE_TOKENS
        if not self._index or m.length >= num_pages * PAGE_TOKENS:
            return m
        keys = _chain(self._fingerprint, namespace, ids, num_pages)
        run: list[tuple[int, bytes]] = []
        for p in range(m.length // PAGE_TOKENS, num_pages):
            if keys[p] not in self._index:
                break
            run.append((p, keys[p]))
        if not run:
            return m
        return self._load(ids, namespace, m, run)

    def _load(
        self, ids: np.ndarray, namespace: Namespace, m: MatchResult, run: list[tuple[int, bytes]]
    ) -> MatchResult:
        reads = []
        for _, key in run:
            page, pending, _ = self._index[key]
            self._index.move_to_end(key)
            reads.append((page, pending))
        payloads = []
        for (page, pending), (_, key) in zip(reads, run, strict=True):
            data = self.l2.read(page, key).result() if _wait(pending) else None
            if data is None:
                self.l2_bad_pages += 1
                self._forget(key)  # doubtful: forget it, recompute
                break
            payloads.append(data)
        end = (run[0][0] + len(payloads)) * PAGE_TOKENS
        if end <= m.length:
            return m
        self.tree.lock(m.node)  # the alloc below may evict; keep the prefix we extend
        try:
            new = self.alloc(end - m.length)
        except OutOfSlotsError:
            self.tree.unlock(m.node)
            return m
        self.tree.unlock(m.node)
        self._scatter(new, payloads, run[0][0] * PAGE_TOKENS, m.length)
        self.l2_read_pages += len(payloads)
        self.l2_hit_tokens += end - m.length
        inserted = self.tree.insert(ids[:end], np.concatenate([m.slots, new]), namespace)
        self.num_in_flight -= end - inserted.prefix_len
        if inserted.prefix_len > m.length:  # cannot happen on one thread; keep the account
            self._free_in_flight(new[: inserted.prefix_len - m.length])
        return self.tree.match(ids, namespace)

    # -- KV copies between the pool and page payloads ----------------------------------------

    def _gather(self, slots: np.ndarray) -> bytes:
        idx = torch.from_numpy(slots)
        k = torch.stack([self.kv.k_cache(i)[idx] for i in range(self.kv.num_layers)])
        v = torch.stack([self.kv.v_cache(i)[idx] for i in range(self.kv.num_layers)])
        both = torch.stack([k, v]).contiguous()  # (2, L, 64, H, D)
        return both.view(torch.uint8).numpy().tobytes()

    def _scatter(self, slots: np.ndarray, payloads: list[bytes], first: int, skip_to: int) -> None:
        """Write the pages' KV from token `skip_to` on (the pages start at token `first`)."""
        kv = self.kv
        shape = (2, kv.num_layers, PAGE_TOKENS, kv.num_kv_heads, kv.head_dim)
        pages = [
            torch.frombuffer(bytearray(p), dtype=torch.uint8).view(kv.dtype).view(shape)
            for p in payloads
        ]
        both = torch.cat(pages, dim=2)[:, :, skip_to - first :]  # (2, L, n, H, D)
        idx = torch.from_numpy(slots)
        for i in range(kv.num_layers):
            kv.k_cache(i)[idx] = both[0, i]
            kv.v_cache(i)[idx] = both[1, i]

    def _path(self, node: TreeNode) -> tuple[np.ndarray, np.ndarray, Namespace]:
        keys: list[bytes] = []
        top = node
        while top.parent is not None:
            keys.append(top.key)
            top = top.parent
        tokens = np.frombuffer(b"".join(reversed(keys)), dtype=np.int64)
        return tokens, self.tree.path_slots(node), top.namespace

    def check_integrity(self) -> None:
        super().check_integrity()
        from radixlm.cache.integrity import IntegrityError

        pages = [page for page, _, _ in self._index.values()]
        if len(set(pages)) != len(pages) or self.l2.num_free + len(pages) != self.l2.num_pages:
            raise IntegrityError(
                f"L2 page account: {self.l2.num_free} free + {len(pages)} indexed "
                f"!= {self.l2.num_pages} pages, or a page indexed twice"
            )

    def close(self) -> None:
        self.l2.close()


def open_tiered_cache(config: CacheConfig, pool: object) -> TieredRadixCache | None:
    """A TieredRadixCache per `config` (l2_dir set), or None, logged, when the page file cannot
    be created (the engine then runs without L2)."""
    assert config.l2_dir is not None
    if not isinstance(pool, KVPool):
        raise ValueError("an L2 tier needs the KV pool itself, not a bare slot allocator")
    path = os.path.join(config.l2_dir, "l2.pages")
    payload = PAGE_TOKENS * pool.bytes_per_slot
    try:
        l2 = L2PageFile(path, config.l2_capacity // PAGE_TOKENS, payload, _fingerprint(pool))
    except L2Error as e:
        log.warning("running without L2: %s", e)
        return None
    return TieredRadixCache(pool, l2, config.page_size, config.eviction)


def _admits(node: TreeNode, turns: TurnTracker) -> bool:
    if node.turn >= 2 or node.hits > 0:
        return True
    rate = turns.return_rate(node.turn)
    return rate is not None and rate >= ADMIT_RATE


def _chain(fingerprint: bytes, namespace: Namespace, tokens: np.ndarray, n: int) -> list[bytes]:
    """The chained keys of the first `n` pages of `tokens`."""
    keys: list[bytes] = []
    prev = None
    for p in range(n):
        prev = page_key(
            fingerprint, namespace, tokens[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS], prev
        )
        keys.append(prev)
    return keys


def _wait(pending: Future[None]) -> bool:
    """Whether a page write completed; a failed one (disk full) is logged and is a miss."""
    try:
        pending.result()
        return True
    except OSError as e:
        log.warning("L2 page write failed (%s); the page is a miss", e)
        return False


def _fingerprint(pool: KVPool) -> bytes:
    """The KV layout pages are only valid for (the file is reinitialised at every start)."""
    return f"{pool.num_layers}x{pool.num_kv_heads}x{pool.head_dim}/{pool.dtype}".encode()
