"""The slot pool: allocation accounting, and the errors that keep ownership honest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.cache.kv_pool import KVPool, OutOfSlotsError, SlotAllocator


def test_alloc_and_free_keep_the_count() -> None:
    pool = SlotAllocator(8)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert pool.num_free == 0 and len(set(a.tolist()) | set(b.tolist())) == 8
    assert a.dtype == np.int64
    pool.free(a)
    assert pool.num_free == 3
    assert sorted(pool.alloc(3).tolist()) == sorted(a.tolist())


def test_out_of_slots_takes_nothing() -> None:
    pool = SlotAllocator(4)
    pool.alloc(3)
    with pytest.raises(OutOfSlotsError) as err:
        pool.alloc(2)
    assert (err.value.requested, err.value.available) == (2, 1) and pool.num_free == 1
    assert pool.alloc(0).size == 0


@pytest.mark.parametrize(
    ("bad", "message"),
    [([7], "not in the pool"), ([-1], "not in the pool"), ([0, 0], "twice"), ([1], "double")],
)
def test_bad_frees_raise(bad: list[int], message: str) -> None:
    pool = SlotAllocator(4)
    pool.alloc(1)  # slot 0 is taken, 1..3 are free
    with pytest.raises(ValueError, match=message):
        pool.free(np.array(bad))
    assert pool.num_free == 3


def test_free_twice_raises() -> None:
    pool = SlotAllocator(4)
    slots = pool.alloc(2)
    pool.free(slots)
    with pytest.raises(ValueError, match="double free"):
        pool.free(slots)


def test_kv_pool_tensors_have_a_row_per_slot() -> None:
    pool = KVPool(num_slots=6, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float16)
    assert pool.k_cache(1).shape == (6, 3, 4) and pool.v_cache(0).dtype == torch.float16
    assert pool.capacity == 6 and pool.bytes_per_slot == 2 * 2 * 3 * 4 * 2
    slots = pool.alloc(2)
    pool.k_cache(0)[torch.from_numpy(slots)] = 1.0
    assert float(pool.k.sum()) == 2 * 3 * 4
