"""The L2 chunk file: round trips, and every doubtful chunk is a miss (wrong key, namespace or
model; a corrupted byte; a torn write), never wrong bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from radixlm.cache.l2.chunk_file import HEADER_BYTES, ChunkFile, L2Error, chunk_key

FP = b"model-a/bfloat16/30x2x3x64"


def payload(seed: int, n: int = 1024) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def chunks(tmp_path: Path) -> Iterator[ChunkFile]:
    f = ChunkFile(str(tmp_path / "l2.chunks"), num_chunks=4, payload_bytes=1024, fingerprint=FP)
    yield f
    f.close()


def test_chunks_round_trip_and_the_free_list_accounts_for_every_chunk(chunks: ChunkFile) -> None:
    keys, held = [], []
    for i in range(4):
        chunk = chunks.alloc()
        assert chunk is not None
        key = chunk_key(FP, None, np.arange(i * 64, (i + 1) * 64))
        chunks.write(chunk, key, payload(i)).result()
        keys.append(key)
        held.append(chunk)
    assert chunks.alloc() is None and chunks.num_free == 0  # full: the caller skips the write
    for i, (chunk, key) in enumerate(zip(held, keys, strict=True)):
        assert chunks.read(chunk, key).result() == payload(i)
    chunks.free(held[0])
    assert chunks.num_free == 1 and chunks.alloc() == held[0]


def test_a_key_from_another_prefix_namespace_or_model_is_a_miss(chunks: ChunkFile) -> None:
    tokens = np.arange(64)
    first = chunk_key(FP, "tenant-a", tokens)
    chunk = chunks.alloc()
    assert chunk is not None
    chunks.write(chunk, first, payload(1)).result()
    assert chunks.read(chunk, first).result() == payload(1)
    assert chunks.read(chunk, chunk_key(FP, "tenant-b", tokens)).result() is None
    assert chunks.read(chunk, chunk_key(b"model-b", "tenant-a", tokens)).result() is None
    assert chunks.read(chunk, chunk_key(FP, "tenant-a", tokens + 1)).result() is None
    # the chain: the same chunk tokens after a different first chunk are another key
    second_after_a = chunk_key(FP, None, tokens, prev=first)
    second_after_b = chunk_key(FP, None, tokens, prev=chunk_key(FP, "tenant-b", tokens))
    assert second_after_a != second_after_b


def test_a_corrupted_or_torn_chunk_is_a_miss(chunks: ChunkFile) -> None:
    key = chunk_key(FP, None, np.arange(64))
    chunk = chunks.alloc()
    assert chunk is not None
    chunks.write(chunk, key, payload(2)).result()
    fd = os.open(chunks.path, os.O_RDWR)
    try:
        offset = chunk * chunks.chunk_bytes + HEADER_BYTES + 500
        os.pwrite(fd, bytes([payload(2)[500] ^ 0xFF]), offset)  # one flipped byte
        assert chunks.read(chunk, key).result() is None
        chunks.write(chunk, key, payload(2)).result()
        assert chunks.read(chunk, key).result() == payload(2)
        os.ftruncate(fd, chunk * chunks.chunk_bytes + HEADER_BYTES + 10)  # a torn tail
        assert chunks.read(chunk, key).result() is None
    finally:
        os.close(fd)


def test_a_chunk_never_written_is_a_miss(chunks: ChunkFile) -> None:
    assert chunks.read(3, chunk_key(FP, None, np.arange(64))).result() is None


def test_an_unusable_directory_is_an_l2_error(tmp_path: Path) -> None:
    with pytest.raises(L2Error, match="L2 chunk file"):
        ChunkFile(str(tmp_path / "missing" / "l2.chunks"), 2, 1024, FP)


def test_a_chunk_file_in_use_by_another_server_is_an_l2_error(chunks: ChunkFile) -> None:
    with pytest.raises(L2Error, match="in use by another process"):
        ChunkFile(chunks.path, 2, 16, b"other")
