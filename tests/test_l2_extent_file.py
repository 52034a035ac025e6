"""The L2 extent file: round trips, and every doubtful extent is a miss (wrong key, namespace or
model; a corrupted byte; a torn write), never wrong bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from radixlm.cache.l2.extent_file import HEADER_BYTES, ExtentFile, L2Error, extent_key

FP = b"model-a/bfloat16/30x2x3x64"


def payload(seed: int, n: int = 1024) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def extents(tmp_path: Path) -> Iterator[ExtentFile]:
    f = ExtentFile(str(tmp_path / "l2.extents"), num_extents=4, payload_bytes=1024, fingerprint=FP)
    yield f
    f.close()


def test_extents_round_trip_and_the_free_list_accounts_for_every_extent(
    extents: ExtentFile,
) -> None:
    keys, held = [], []
    for i in range(4):
        extent = extents.alloc()
        assert extent is not None
        key = extent_key(FP, None, np.arange(i * 64, (i + 1) * 64))
        extents.write(extent, key, payload(i)).result()
        keys.append(key)
        held.append(extent)
    assert extents.alloc() is None and extents.num_free == 0  # full: the caller skips the write
    for i, (extent, key) in enumerate(zip(held, keys, strict=True)):
        assert extents.read(extent, key).result() == payload(i)
    extents.free(held[0])
    assert extents.num_free == 1 and extents.alloc() == held[0]


def test_a_key_from_another_prefix_namespace_or_model_is_a_miss(extents: ExtentFile) -> None:
    tokens = np.arange(64)
    first = extent_key(FP, "tenant-a", tokens)
    extent = extents.alloc()
    assert extent is not None
    extents.write(extent, first, payload(1)).result()
    assert extents.read(extent, first).result() == payload(1)
    assert extents.read(extent, extent_key(FP, "tenant-b", tokens)).result() is None
    assert extents.read(extent, extent_key(b"model-b", "tenant-a", tokens)).result() is None
    assert extents.read(extent, extent_key(FP, "tenant-a", tokens + 1)).result() is None
    # the chain: the same extent tokens after a different first extent are another key
    second_after_a = extent_key(FP, None, tokens, prev=first)
    second_after_b = extent_key(FP, None, tokens, prev=extent_key(FP, "tenant-b", tokens))
    assert second_after_a != second_after_b


def test_a_corrupted_or_torn_extent_is_a_miss(extents: ExtentFile) -> None:
    key = extent_key(FP, None, np.arange(64))
    extent = extents.alloc()
    assert extent is not None
    extents.write(extent, key, payload(2)).result()
    fd = os.open(extents.path, os.O_RDWR)
    try:
        offset = extent * extents.extent_bytes + HEADER_BYTES + 500
        os.pwrite(fd, bytes([payload(2)[500] ^ 0xFF]), offset)  # one flipped byte
        assert extents.read(extent, key).result() is None
        extents.write(extent, key, payload(2)).result()
        assert extents.read(extent, key).result() == payload(2)
        os.ftruncate(fd, extent * extents.extent_bytes + HEADER_BYTES + 10)  # a torn tail
        assert extents.read(extent, key).result() is None
    finally:
        os.close(fd)


def test_a_extent_never_written_is_a_miss(extents: ExtentFile) -> None:
    assert extents.read(3, extent_key(FP, None, np.arange(64))).result() is None


def test_an_unusable_directory_is_an_l2_error(tmp_path: Path) -> None:
    with pytest.raises(L2Error, match="L2 extent file"):
        ExtentFile(str(tmp_path / "missing" / "l2.extents"), 2, 1024, FP)


def test_a_extent_file_in_use_by_another_server_is_an_l2_error(extents: ExtentFile) -> None:
    with pytest.raises(L2Error, match="in use by another process"):
        ExtentFile(extents.path, 2, 16, b"other")
