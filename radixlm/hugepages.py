"""Memory that the CPU streams through, on 2 MiB pages where Linux allows it.

A decode step reads every weight and a run of K/V rows per request from DRAM. On 4 KiB pages
the hardware prefetchers stop at each page boundary and every page costs a TLB entry; on 2 MiB
pages they run on. Linux hands out such pages (transparent huge pages) to memory advised with
MADV_HUGEPAGE before it is first touched, when /sys/kernel/mm/transparent_hugepage/enabled is
`madvise` (the default on many distributions) or `always`. What it bought is measured in
docs/model.md ("What made the difference").

`empty` asks for them and falls back to plain memory where it cannot (another OS, THP off):
the advice changes speed, never results. An `Arena` carves many tensors out of one such
allocation (the model's packed weights are 121 matrices of 0.6-56 MB).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch

PAGE = 2 << 20  # the huge page size on x86-64 and most aarch64 kernels
ALIGN = 64  # each arena slice starts on a cache line
MADV_HUGEPAGE = 14


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def empty(num_bytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of num_bytes whose whole 2 MiB pages were advised to
    be huge before anything touched them (small ones: plain)."""
    if _MADVISE is None or num_bytes < PAGE:
        return torch.empty(num_bytes, dtype=torch.uint8)
    raw = torch.empty(num_bytes + PAGE, dtype=torch.uint8)  # fresh: a large allocation is mmapped
    skip = -raw.data_ptr() % PAGE
    _MADVISE(raw.data_ptr() + skip, num_bytes // PAGE * PAGE, MADV_HUGEPAGE)  # advice only
    return raw[skip : skip + num_bytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on huge pages where allowed."""
    numel = 1
    for n in shape:
        numel *= n
    size = torch.empty(0, dtype=dtype).element_size()
    return empty(numel * size).view(dtype).view(shape).zero_()


class Arena:
    """One huge-page allocation handed out as tensors, each aligned to a cache line. The slices
    keep the allocation alive; nothing is freed before all of them are."""

    def __init__(self, num_bytes: int):
        self._buffer = empty(num_bytes)
        self._used = 0

    @staticmethod
    def size_of(numel: int, dtype: torch.dtype) -> int:
        """Bytes a `take` of numel elements uses, alignment included."""
        size = numel * torch.empty(0, dtype=dtype).element_size()
        return -(-size // ALIGN) * ALIGN

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor from the arena; raises when it does not fit."""
        numel = 1
        for n in shape:
            numel *= n
        size = self.size_of(numel, dtype)
        if self._used + size > self._buffer.numel():
            raise MemoryError(f"arena of {self._buffer.numel()} bytes: no room for {size} more")
        start, self._used = self._used, self._used + size
        element = torch.empty(0, dtype=dtype).element_size()
        return self._buffer[start : start + numel * element].view(dtype).view(shape)
