"""The L2 page file: round trips, and every doubtful page is a miss (wrong key, namespace or
model; a corrupted byte; a torn write), never wrong bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from radixlm.cache.l2_pages import HEADER_BYTES, L2Error, L2PageFile, page_key

FP = b"model-a/bfloat16/30x2x3x64"


def payload(seed: int, n: int = 1024) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def pages(tmp_path: Path) -> Iterator[L2PageFile]:
    f = L2PageFile(str(tmp_path / "l2.pages"), num_pages=4, payload_bytes=1024, fingerprint=FP)
    yield f
    f.close()


def test_pages_round_trip_and_the_free_list_accounts_for_every_page(pages: L2PageFile) -> None:
    keys, held = [], []
    for i in range(4):
        page = pages.alloc()
        assert page is not None
        key = page_key(FP, None, np.arange(i * 64, (i + 1) * 64))
        pages.write(page, key, payload(i)).result()
        keys.append(key)
        held.append(page)
    assert pages.alloc() is None and pages.num_free == 0  # full: the caller skips the write
    for i, (page, key) in enumerate(zip(held, keys, strict=True)):
        assert pages.read(page, key).result() == payload(i)
    pages.free(held[0])
    assert pages.num_free == 1 and pages.alloc() == held[0]


def test_a_key_from_another_prefix_namespace_or_model_is_a_miss(pages: L2PageFile) -> None:
    tokens = np.arange(64)
    first = page_key(FP, "tenant-a", tokens)
    page = pages.alloc()
    assert page is not None
    pages.write(page, first, payload(1)).result()
    assert pages.read(page, first).result() == payload(1)
    assert pages.read(page, page_key(FP, "tenant-b", tokens)).result() is None
    assert pages.read(page, page_key(b"model-b", "tenant-a", tokens)).result() is None
    assert pages.read(page, page_key(FP, "tenant-a", tokens + 1)).result() is None
    # the chain: the same page tokens after a different first page are another key
    second_after_a = page_key(FP, None, tokens, prev=first)
    second_after_b = page_key(FP, None, tokens, prev=page_key(FP, "tenant-b", tokens))
    assert second_after_a != second_after_b


def test_a_corrupted_or_torn_page_is_a_miss(pages: L2PageFile) -> None:
    key = page_key(FP, None, np.arange(64))
    page = pages.alloc()
    assert page is not None
    pages.write(page, key, payload(2)).result()
    fd = os.open(pages.path, os.O_RDWR)
    try:
        offset = page * pages.page_bytes + HEADER_BYTES + 500
        os.pwrite(fd, bytes([payload(2)[500] ^ 0xFF]), offset)  # one flipped byte
        assert pages.read(page, key).result() is None
        pages.write(page, key, payload(2)).result()
        assert pages.read(page, key).result() == payload(2)
        os.ftruncate(fd, page * pages.page_bytes + HEADER_BYTES + 10)  # a torn tail
        assert pages.read(page, key).result() is None
    finally:
        os.close(fd)


def test_a_page_never_written_is_a_miss(pages: L2PageFile) -> None:
    assert pages.read(3, page_key(FP, None, np.arange(64))).result() is None


def test_an_unusable_directory_is_an_l2_error(tmp_path: Path) -> None:
    with pytest.raises(L2Error, match="L2 page file"):
        L2PageFile(str(tmp_path / "missing" / "l2.pages"), 2, 1024, FP)


def test_a_page_file_in_use_by_another_server_is_an_l2_error(pages: L2PageFile) -> None:
    with pytest.raises(L2Error, match="in use by another process"):
        L2PageFile(pages.path, 2, 16, b"other")
