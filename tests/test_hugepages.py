"""radixlm.hugepages: tensors on memory advised for huge pages behave as plain tensors."""

from __future__ import annotations

from math import prod

import pytest
import torch

from radixlm import hugepages


@pytest.mark.parametrize("num_bytes", [100, hugepages.PAGE * 3 + 5])
def test_empty_and_zeros_are_plain_tensors(num_bytes: int) -> None:
    buffer = hugepages.empty(num_bytes)
    assert buffer.shape == (num_bytes,) and buffer.dtype == torch.uint8
    buffer.fill_(7)  # every byte writable
    assert int(buffer.sum()) == 7 * num_bytes
    z = hugepages.zeros((3, num_bytes // 12 + 1, 2), torch.bfloat16)
    assert z.shape == (3, num_bytes // 12 + 1, 2) and z.dtype == torch.bfloat16
    assert z.is_contiguous() and not z.any()


def test_arena_slices_are_aligned_disjoint_and_bounded() -> None:
    shapes = [((5, 3), torch.float32), ((7,), torch.bfloat16), ((2, 2, 2), torch.float32)]
    arena = hugepages.Arena(sum(hugepages.Arena.size_of(prod(s), d) for s, d in shapes))
    taken = [arena.take(shape, dtype) for shape, dtype in shapes]
    for (shape, dtype), t in zip(shapes, taken):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % hugepages.ALIGN == 0
    for i, t in enumerate(taken):  # writing one leaves the others alone
        t.fill_(i + 1)
    for i, t in enumerate(taken):
        assert bool((t == i + 1).all())
    with pytest.raises(MemoryError, match="no room"):
        arena.take((1,), torch.float32)
