"""KV copies between the slot pool and extent payloads (the disk tier's unit, cache/l2/node.py).

A payload is one extent's K and V for every layer, contiguous: (2, layers, tokens, kv_heads,
head_dim) in the pool's dtype, 64 tokens (fewer in a tail extent); an int8 pool's payload goes
on with the rows' scales, (2, layers, tokens, kv_heads) bfloat16, so an extent read back holds
the very bytes that were written (`pool.bytes_per_slot` per token either way).

An extent written as its node leaves RAM is gathered on the engine thread (its slots are freed
right after); an extent written through when its request finishes is gathered on the I/O thread
(`StagedExtent`), from slots the tree still owns. Loaded extents are scattered on the I/O
threads as each read is verified, so copies overlap the reads. A `LoadSink` is cancelled when
its load ends: after `cancel()` returns no late read writes into slots that may have been given
to another request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from radixlm.cache.kv_pool import KVPool


def gather_extent(pool: KVPool, slots: np.ndarray) -> memoryview:
    """The payload of one extent whose tokens' KV is in `slots` (a fresh buffer, not a copy of
    the pool: the slots may be reused at once)."""
    idx, dim = torch.from_numpy(slots), _slot_dim(pool)
    parts = []
    for k_all, v_all in _pool_tensors(pool):  # the values (or codes), then any scales
        k, v = k_all.index_select(dim, idx), v_all.index_select(dim, idx)
        if pool.head_major:  # (L, H, n, ...) -> (L, n, H, ...)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        both = torch.stack([k, v]).contiguous()  # (2, L, n, H, D), or (2, L, n, H) for scales
        parts.append(both.view(torch.uint8).reshape(-1))
    return torch.cat(parts).numpy().data


class StagedExtent:
    """One extent's payload, gathered on the I/O thread when its write runs, from slots the tree
    owns until `settle()`: the tree settles an extent before freeing any slot it reads, so a
    gather never reads a reused slot and the engine thread copies nothing at finish."""

    QUEUED, COPIED, CANCELLED = range(3)

    def __init__(self, pool: KVPool, slots: np.ndarray, key: bytes) -> None:
        self.pool = pool
        self.slots = slots  # the extent's slot ids (tree-owned while the extent is staged)
        self.key = key
        self._lock = threading.Lock()  # held during the gather and by settle
        self._state = self.QUEUED

    def gather(self) -> memoryview | None:
        """The payload, on the I/O thread; None once settled uncopied (the write is skipped)."""
        with self._lock:
            if self._state == self.CANCELLED:
                return None
            payload = gather_extent(self.pool, self.slots)
            self._state = self.COPIED
            return payload

    def settle(self) -> bool:
        """Whether the payload was copied; if not, it never will be (the write is skipped).
        Waits for a gather in progress (a memory copy, never the disk). After this returns
        the slots may be freed."""
        with self._lock:
            if self._state == self.COPIED:
                return True
            self._state = self.CANCELLED
            return False


class LoadSink:
    """Scatters the verified extents of one load into its slots, until cancelled."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.dim = _slot_dim(pool)
        self._lock = threading.Lock()  # held while an extent is copied and by cancel
        self._cancelled = False

    def extent(self, slots: np.ndarray, skip: int) -> Callable[[bytearray], None]:
        """The sink of one extent: its tokens from `skip` on go to `slots` (the first `skip`
        tokens were in RAM already)."""
        idx, pool = torch.from_numpy(slots), self.pool

        def copy(payload: bytearray) -> None:
            raw = torch.frombuffer(payload, dtype=torch.uint8)
            num_tokens = raw.numel() // pool.bytes_per_slot
            pieces, at = [], 0
            for k_all, v_all in _pool_tensors(pool):
                row = k_all.shape[3:]  # (D,) for values or codes, () for scales
                shape = (2, pool.num_layers, num_tokens, pool.num_kv_heads, *row)
                size = 2 * pool.num_layers * num_tokens * pool.num_kv_heads * row.numel()
                nbytes = size * k_all.element_size()
                k, v = raw[at : at + nbytes].view(k_all.dtype).view(shape)[:, :, skip:]
                if pool.head_major:  # (L, n, H, ...) -> (L, H, n, ...)
                    k, v = k.transpose(1, 2), v.transpose(1, 2)
                pieces.append((k_all, v_all, k, v))
                at += nbytes
            with self._lock:
                if self._cancelled:
                    return
                for k_all, v_all, k, v in pieces:  # every layer in one call
                    k_all.index_copy_(self.dim, idx, k)
                    v_all.index_copy_(self.dim, idx, v)

        return copy

    def cancel(self) -> None:
        """No extent is copied after this returns."""
        with self._lock:
            self._cancelled = True


def _pool_tensors(pool: KVPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pool's (K, V) tensor pairs in payload order: the values or codes, then an int8
    pool's scales."""
    pairs = [(pool.k, pool.v)]
    if pool.k_scales is not None and pool.v_scales is not None:
        pairs.append((pool.k_scales, pool.v_scales))
    return pairs


def _slot_dim(pool: KVPool) -> int:
    """The slot dimension of the pool's K and V tensors (see KVPool's layouts)."""
    return 2 if pool.head_major else 1
