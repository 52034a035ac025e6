"""L2Store: where a tiered tree's chunks live, and which nodes are worth writing there.

`ChunkStore` is what the tree (cache/l2/tree.py) asks of it; L2Store is the one on disk.

The tree (cache/l2/tree.py) decides which chunks a node holds; the store decides whether a node
is worth a write (the *write filter*: a hit, a conversation's second turn or later, or a first
turn once enough of them measurably came back, cache/turns.py; the client's
`prompt_cache_retention` overrides it), hands chunks to the chunk file's I/O threads
(cache/l2/chunk_file.py) and reads them back for loads (cache/l2/loads.py).

A finished request's path is written through: each chunk's KV is gathered on an I/O thread
from slots the tree still owns (`StagedChunk`), and the tree calls `settle` before it frees any
of them, which waits only for a gather in progress (a memory copy) and copies one not started
yet itself. A node that leaves RAM unwritten is gathered on the engine thread, as its slots are
freed right after. A chunk is reused only once its last write is done, and a failed write
(disk full) makes the chunk a miss.

Accounting: free chunks (the file's free list) + chunks held by nodes == num_chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from radixlm.cache.kv_pool import KVPool
from radixlm.cache.l2.chunk_copy import StagedChunk, gather_chunk
from radixlm.cache.l2.chunk_file import ChunkFile, chunk_key
from radixlm.cache.l2.node import CHUNK_TOKENS
from radixlm.cache.tree_node import DEFAULT_RETENTION, KEEP, Namespace, TreeNode
from radixlm.cache.turns import TurnTracker

log = logging.getLogger(__name__)

WRITE_RETURN_RATE = 0.25  # a first turn is written once this share of first turns came back


class ChunkStore(Protocol):
    """Where a TieredTree's chunks live (cache/l2/store.py)."""

    def worth_writing(self, node: TreeNode, turns: TurnTracker) -> bool:
        """Whether `node` is worth writing to L2 (likely to be asked for again)."""

    @property
    def num_free_chunks(self) -> int: ...

    def write_node(self, node: TreeNode, first: int, count: int, staged: bool) -> np.ndarray:
        """Write chunks first .. first+count-1 of `node`'s path; the ids of the leading ones
        written (fewer when too few are free). `staged`: the KV is copied on the I/O thread,
        and the tree calls `settle(node)` before it frees a slot of the node."""

    def settle(self, node: TreeNode) -> None:
        """`node`, holding chunks, leaves RAM: its staged chunks' KV is copied out of its
        slots before they are freed."""

    def free_chunks(self, chunks: np.ndarray) -> None:
        """Give chunks back once no node holds them."""


class L2Store:
    """The chunks of one chunk file for one KV pool (see the module docstring)."""

    def __init__(self, file: ChunkFile, kv: KVPool) -> None:
        self.file = file
        self.kv = kv
        self._pending: dict[int, Future[None]] = {}  # chunk -> its last write
        self._staged: dict[int, StagedChunk] = {}  # chunk -> its write through, until settled
        self._fingerprint = file.fingerprint  # in every chunk key: another layout never matches
        self.written_chunks = 0
        self.through_chunks = 0  # written when a request finished, not when RAM evicted
        self.settled_chunks = 0  # written through, but copied at eviction: not started yet

    # -- what the tree asks ----------------------------------------------------------------

    def worth_writing(self, node: TreeNode, turns: TurnTracker) -> bool:
        """The write filter: whether `node` is likely to be asked for again (the module)."""
        if node.retention != DEFAULT_RETENTION:  # the client said (RAM_ONLY or KEEP)
            return node.retention == KEEP
        if node.turn >= 2 or node.hits > 0:
            return True
        rate = turns.return_rate(node.turn)
        return rate is not None and rate >= WRITE_RETURN_RATE

    @property
    def num_free_chunks(self) -> int:
        return self.file.num_free

    def write_node(self, node: TreeNode, first: int, count: int, staged: bool) -> np.ndarray:
        """Write chunks first .. first+count-1 of `node`'s path into free chunks; the ids of the
        leading ones written (fewer when too few are free). Not `staged`: the KV is gathered
        now (the slots are freed next). `staged`: it is gathered on the I/O thread, and the
        tree calls `settle(node)` before it frees a slot of the node."""
        chunks = [c for c in (self.file.alloc() for _ in range(count)) if c is not None]
        if not chunks:
            return np.empty(0, dtype=np.int64)
        tokens, slots, namespace = _path(node)
        keys = self.keys(namespace, tokens, first + len(chunks))
        for i, chunk in enumerate(chunks):
            c = first + i
            chunk_slots = slots[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS]
            payload: Callable[[], memoryview | None] | memoryview
            if staged:
                stage = self._staged[chunk] = StagedChunk(self.kv, chunk_slots, keys[c])
                payload = stage.gather
            else:
                payload = gather_chunk(self.kv, chunk_slots)
            self._pending[chunk] = self.file.write(chunk, keys[c], payload)
        self.written_chunks += len(chunks)
        self.through_chunks += len(chunks) if staged else 0
        if len(self._pending) > 4 * self.file.num_chunks // 3 + 64:
            self._pending = {c: f for c, f in self._pending.items() if not f.done()}
            self._staged = {c: s for c, s in self._staged.items() if c in self._pending}
        return np.array(chunks, dtype=np.int64)

    def settle(self, node: TreeNode) -> None:
        """`node`, holding chunks, leaves RAM: finish copying its staged chunks' KV out of its
        slots (or copy it now) before they are freed."""
        assert node.l2 is not None and node.l2.chunks is not None
        for chunk in node.l2.chunks.tolist():
            stage = self._staged.pop(chunk, None)
            if stage is not None and not stage.settle():  # its write has not started: copy now
                payload = gather_chunk(self.kv, stage.slots)
                self._pending[chunk] = self.file.write(chunk, stage.key, payload)
                self.settled_chunks += 1

    def free_chunks(self, chunks: np.ndarray) -> None:
        """Give chunks back once no node holds them."""
        for chunk in chunks.tolist():
            stage = self._staged.pop(chunk, None)
            pending = self._pending.pop(chunk, None)
            # A chunk is reused only once its last write is done; a staged one that was not
            # copied yet never writes (no wait behind a slow disk for it).
            if pending is not None and (stage is None or stage.settle()):
                _wait(pending)
            self.file.free(chunk)

    # -- what loads ask --------------------------------------------------------------------

    def keys(self, namespace: Namespace, tokens: np.ndarray, n: int) -> list[bytes]:
        """The chained keys of the first `n` chunks of `tokens` (the last one partial when
        `tokens` ends inside it: a tail chunk)."""
        keys: list[bytes] = []
        prev = None
        for c in range(n):
            chunk_tokens = tokens[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS]
            prev = chunk_key(self._fingerprint, namespace, chunk_tokens, prev)
            keys.append(prev)
        return keys

    def written(self, chunk: int) -> bool:
        """Whether `chunk`'s last write is done and succeeded (a failed one is a miss)."""
        pending = self._pending.pop(chunk, None)
        return pending is None or _wait(pending)

    def wait_writes(self) -> None:
        """Block until every write queued so far is done (tests; a failed one is logged)."""
        for pending in list(self._pending.values()):
            _wait(pending)

    def close(self) -> None:
        self.file.close()


def _path(node: TreeNode) -> tuple[np.ndarray, np.ndarray, Namespace]:
    """The tokens and slots from the root down to `node`, and its namespace."""
    keys: list[bytes] = []
    values: list[np.ndarray] = []
    top = node
    while top.parent is not None:
        keys.append(top.key)
        values.append(top.value)
        top = top.parent
    tokens = np.frombuffer(b"".join(reversed(keys)), dtype=np.int64)
    slots = np.concatenate(values[::-1]) if values else np.empty(0, dtype=np.int64)
    return tokens, slots, top.namespace


def _wait(pending: Future[None]) -> bool:
    """Whether a chunk write completed; a failed one (disk full) is logged and is a miss."""
    try:
        pending.result()
        return True
    except OSError as e:
        log.warning("L2 chunk write failed (%s); the chunk is a miss", e)
        return False


def fingerprint(pool: KVPool) -> bytes:
    """The KV layout chunks are only valid for (the file is reinitialised at every start)."""
    return f"{pool.num_layers}x{pool.num_kv_heads}x{pool.head_dim}/{pool.dtype}".encode()
