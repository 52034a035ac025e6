"""The extent file: one preallocated file of fixed-size extents of KV on local disk (the L2 tier).

An extent holds the KV of up to 64 consecutive tokens (all layers, contiguous) behind a small
header. Extents are read and written with positional I/O (os.pread / os.pwrite) from small
thread pools, so the engine thread never blocks on the disk and the file is never mmapped (a
mapped pool would fault inside the kernels and write back every KV store).

    offset = extent * extent_bytes
    [ magic 4 | payload length 4 | key 16 | checksum 16 | pad to 64 ][ payload ........ ]

Nothing read back is trusted: the key is a digest of the file's fingerprint (model, dtype,
layout), the namespace (cache salt) and every token id up to the end of the extent, and the
checksum covers the key and the payload. An extent whose magic, key or checksum does not match is
a miss (None), so a torn write, a corrupted sector or a file from another model is recomputed,
never served. The file is reinitialised when opened (no extent survives a restart) and locked
(flock) while open, so two servers never share one. `faults` lets a test delay or fail the I/O
the way a slow or full disk would.

Invariant: every extent index is either on the free list or allocated, never both;
`num_free + num_allocated == num_extents`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from radixlm.cache.tree_node import Namespace

if TYPE_CHECKING:
    from typing_extensions import Buffer  # a payload: any C-contiguous buffer

MAGIC = b"RLM2"
HEADER_BYTES = 64
KEY_BYTES = 16
_LOCKED = (errno.EAGAIN, errno.EACCES)


class L2Error(OSError):
    """The extent file cannot be created or used; the caller runs without L2."""


@dataclass(frozen=True)
class Faults:
    """Fault injection for tests: each hook, when set, is called with the extent index on the I/O
    thread before that extent is read or written. It may block (a slow disk) or raise OSError (a
    failing one: a failed read is a miss, a failed write raises from its future)."""

    read: Callable[[int], None] | None = None
    write: Callable[[int], None] | None = None


def extent_key(
    fingerprint: bytes, namespace: Namespace, tokens: np.ndarray, prev: bytes | None = None
) -> bytes:
    """The key of the extent ending after `tokens`: chained, so `prev` (the key of the extent
    before, None for the first) stands for every earlier token. int64 token ids."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    if prev is None:
        h.update(fingerprint)
        h.update(b"\0" if namespace is None else b"\1" + namespace.encode())
    else:
        h.update(prev)
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class ExtentFile:
    """A fixed number of fixed-size extents in one file (see the module docstring)."""

    def __init__(
        self, path: str, num_extents: int, payload_bytes: int, fingerprint: bytes, threads: int = 2
    ) -> None:
        if num_extents < 1 or payload_bytes < 1:
            raise ValueError("num_extents and payload_bytes must be >= 1")
        self.path = path
        self.num_extents = num_extents
        self.payload_bytes = payload_bytes
        self.extent_bytes = HEADER_BYTES + payload_bytes
        self.fingerprint = fingerprint
        self.faults = Faults()
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise L2Error(f"L2 extent file {path}: {e.strerror or e}") from e
        try:
            # One process per file: another server's extents (maybe another model of the same
            # shape, whose keys would match) must never be read as ours.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(self._fd, 0)
            os.ftruncate(self._fd, num_extents * self.extent_bytes)  # sparse until written
        except OSError as e:
            os.close(self._fd)
            reason = "in use by another process" if e.errno in _LOCKED else e.strerror or e
            raise L2Error(f"L2 extent file {path}: {reason}") from e
        self._free = list(range(num_extents - 1, -1, -1))  # pop() hands out extent 0 first
        self._lock = threading.Lock()  # guards the free list (I/O threads never touch it)
        self._io_lock = threading.Lock()  # guards the byte counters the I/O threads update
        self.written_bytes = self.read_bytes = 0  # payload bytes moved (a tail extent's are fewer)
        # Reads have threads of their own: a load someone waits for never queues behind the
        # writes of the evictions that made room for it.
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l2-write")
        self._reads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l2-read")

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free extent index, or None when every extent is allocated."""
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, extent: int) -> None:
        """Return `extent` to the free list; its old contents stay until overwritten."""
        with self._lock:
            self._free.append(extent)

    def write(
        self, extent: int, key: bytes, payload: Buffer | Callable[[], Buffer | None]
    ) -> Future[None]:
        """Store `payload` under `key` in `extent` (checksum and I/O off the calling thread). A
        failed write (disk full) raises from the future's result; the caller then frees the
        extent. `payload` must not change until the future is done; a callable is called on the
        I/O thread for it, and None from it skips the write."""
        if len(key) != KEY_BYTES:
            raise ValueError("a malformed extent key")
        if not callable(payload):
            self._check_size(payload)
        return self._io.submit(self._pwrite, extent, key, payload)

    def read(
        self, extent: int, key: bytes, sink: Callable[[bytearray], None] | None = None
    ) -> Future[bytearray | None]:
        """The payload of `extent` if it holds `key` intact, else None (a miss). `sink`, if
        given, is called with a verified payload on the I/O thread (to copy it in place)."""
        return self._reads.submit(self._pread, extent, key, sink)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        os.close(self._fd)

    def _check_size(self, payload: Buffer) -> None:
        if memoryview(payload).nbytes > self.payload_bytes:
            raise ValueError("payload too large for an extent")

    def _pwrite(
        self, extent: int, key: bytes, payload: Buffer | Callable[[], Buffer | None]
    ) -> None:
        if self.faults.write is not None:
            self.faults.write(extent)
        data = payload() if callable(payload) else payload
        if data is None:
            return  # a staged payload that was settled before it was copied
        if callable(payload):
            self._check_size(data)
        parts = [memoryview(_header(key, data)), memoryview(data).cast("B")]
        offset = extent * self.extent_bytes
        while parts:  # a short write continues where it stopped
            written = os.pwritev(self._fd, parts, offset)
            offset += written
            while parts and written >= len(parts[0]):
                written -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][written:]
        with self._io_lock:
            self.written_bytes += memoryview(data).nbytes

    def _pread(
        self, extent: int, key: bytes, sink: Callable[[bytearray], None] | None
    ) -> bytearray | None:
        try:
            if self.faults.read is not None:
                self.faults.read(extent)
            header = os.pread(self._fd, HEADER_BYTES, extent * self.extent_bytes)
        except OSError:
            return None
        if len(header) < HEADER_BYTES or header[:4] != MAGIC or header[8:24] != key:
            return None
        length = int.from_bytes(header[4:8], "little")
        if length > self.payload_bytes:
            return None
        payload = bytearray(length)  # read in place: torch.frombuffer takes it without a copy
        try:
            n = os.preadv(self._fd, [payload], extent * self.extent_bytes + HEADER_BYTES)
        except OSError:
            return None
        with self._io_lock:
            self.read_bytes += n
        if n != length or _checksum(key, payload) != header[24:40]:
            return None
        if sink is not None:
            sink(payload)
        return payload


def _checksum(key: bytes, payload: Buffer) -> bytes:
    # SHA-256 runs on the CPU's SHA extensions where present: over twice blake2b's speed there
    h = hashlib.sha256(key)
    h.update(payload)
    return h.digest()[:16]


def _header(key: bytes, payload: Buffer) -> bytes:
    length = memoryview(payload).nbytes
    head = MAGIC + length.to_bytes(4, "little") + key + _checksum(key, payload)
    return head.ljust(HEADER_BYTES, b"\0")
