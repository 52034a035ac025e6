"""The KV slot pool: preallocated K/V tensors for every layer and the free list of slots.

A *slot* is the KV location of one token: row `s` of `k[layer]` and `v[layer]`. The pool hands
slots out and takes them back; it never knows who holds them (the prefix cache keeps that
account). Slot ids are numpy int64 arrays everywhere in the cache layer; the model side turns
them into torch tensors without a copy (`torch.from_numpy`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from radixlm import hugepages


class OutOfSlotsError(RuntimeError):
    """Raised when more slots are asked for than are free."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"KV pool out of slots: requested {requested}, {available} free")
        self.requested = requested
        self.available = available


class SlotAllocator:
    """A free list over `capacity` slot ids with double-free and unknown-slot detection."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # A stack: the most recently freed slots are reused first (warm in the CPU caches).
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._num_free = capacity
        self._is_free = np.ones(capacity, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> np.ndarray:
        """Take `n` free slots. Raises OutOfSlotsError (and takes nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self._num_free:
            raise OutOfSlotsError(n, self._num_free)
        start = self._num_free - n
        slots = self._free[start : self._num_free][::-1].copy()
        self._num_free = start
        self._is_free[slots] = False
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Return slots. Raises ValueError for an unknown slot, a slot already free, or a repeat."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return
        if slots.min() < 0 or slots.max() >= self.capacity:
            bad = slots[(slots < 0) | (slots >= self.capacity)][0]
            raise ValueError(f"slot {bad} is not in the pool (capacity {self.capacity})")
        if self._is_free[slots].any():
            bad = slots[self._is_free[slots]][0]
            raise ValueError(f"double free of slot {bad}")
        if np.unique(slots).size != slots.size:
            raise ValueError("the same slot is freed twice in one call")
        self._is_free[slots] = True
        self._free[self._num_free : self._num_free + slots.size] = slots
        self._num_free += slots.size


class KVScales(NamedTuple):
    """An int8 pool layer's scales: one bfloat16 per row (kv_quant.py), (num_slots, kv_heads)
    views laid out as the codes are (head-major on CPU)."""

    k: torch.Tensor
    v: torch.Tensor


class LayerKV(NamedTuple):
    """One layer of the pool as the model reads and writes it: K and V views (num_slots,
    kv_heads, head_dim), and for an int8 pool their scales (None for float pools)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: KVScales | None


class KVPool:
    """K and V tensors for num_layers x num_slots x num_kv_heads rows of head_dim, and the slots.

    `k_cache(layer)` / `v_cache(layer)` are views of shape [num_slots, num_kv_heads, head_dim]
    (`layer(i)` gives both, with the scales of an int8 pool); the model writes new tokens' K/V
    at their slots and gathers a sequence's slots to attend.

    dtype float32, bfloat16 or float16 stores the values; int8 stores codes, with one bfloat16
    scale per (slot, kv head) row in `k_scales` / `v_scales`, shaped as the codes without
    head_dim (the format: cache/kv_quant.py): about half the bytes of bfloat16 per token.

    Underneath, a CPU pool is head-major, [num_layers, num_kv_heads, num_slots, head_dim]: one
    kv head's rows of consecutive slots lie next to each other, so decode attention, which reads
    one kv head of a run of slots at a time, streams memory in order instead of taking a third
    of every slot's row (DRAM serves strided lines at a fraction of its in-order rate; the
    figures are in docs/kernels.md). The views are
    then strided (the native kernels take the strides; PyTorch's ops take any). Other devices
    keep [num_layers, num_slots, num_kv_heads, head_dim], whose views are contiguous.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.allocator = SlotAllocator(num_slots)
        self.head_major = torch.device(device).type == "cpu"
        if self.head_major:
            shape = (num_layers, num_kv_heads, num_slots, head_dim)
        else:
            shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k, self.v = _zeros(shape, dtype, device), _zeros(shape, dtype, device)
        self.k_scales: torch.Tensor | None = None  # int8 pools: (shape without head_dim)
        self.v_scales: torch.Tensor | None = None
        if dtype == torch.int8:
            self.k_scales = _zeros(shape[:-1], torch.bfloat16, device)
            self.v_scales = _zeros(shape[:-1], torch.bfloat16, device)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self._addresses: torch.Tensor | None = None  # layer_addresses(), built on first use

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def quantized(self) -> bool:
        """Whether the pool holds int8 codes and scales (kv_quant.py)."""
        return self.k_scales is not None

    @property
    def bytes_per_slot(self) -> int:
        """One token's K and V in every layer, scales included."""
        return slot_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def alloc(self, n: int) -> np.ndarray:
        return self.allocator.alloc(n)

    def free(self, slots: np.ndarray) -> None:
        self.allocator.free(slots)

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K as a [num_slots, num_kv_heads, head_dim] view."""
        return self.k[layer].transpose(0, 1) if self.head_major else self.k[layer]

    def kv_strides(self) -> tuple[int, int]:
        """The layer views' (slot, head) strides in elements, for native code."""
        stride = self.k_cache(0).stride()
        return stride[0], stride[1]

    def scale_strides(self) -> tuple[int, int]:
        """The layer scale views' (slot, head) strides in elements, for native code; (0, 0)
        for a float pool, which has none."""
        scales = self.layer(0).scales
        if scales is None:
            return 0, 0
        stride = scales.k.stride()
        return stride[0], stride[1]

    def layer_addresses(self) -> torch.Tensor:
        """(num_layers, 4) int64: where each layer's K and V views start, and its K and V
        scales (0 for a float pool), for native code that walks the layers itself. Fixed for
        the pool's life (its tensors never move)."""
        if self._addresses is None:
            rows = []
            for i in range(self.num_layers):
                row = [self.k[i].data_ptr(), self.v[i].data_ptr(), 0, 0]
                if self.k_scales is not None and self.v_scales is not None:
                    row[2:] = [self.k_scales[i].data_ptr(), self.v_scales[i].data_ptr()]
                rows.append(row)
            self._addresses = torch.tensor(rows, dtype=torch.int64)
        return self._addresses

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s V as a [num_slots, num_kv_heads, head_dim] view."""
        return self.v[layer].transpose(0, 1) if self.head_major else self.v[layer]

    def layer(self, layer: int) -> LayerKV:
        """Layer `layer`'s K and V views, and their scales' (num_slots, kv_heads) views for an
        int8 pool."""
        scales = None
        if self.k_scales is not None and self.v_scales is not None:
            ks, vs = self.k_scales[layer], self.v_scales[layer]
            if self.head_major:
                ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)
            scales = KVScales(ks, vs)
        return LayerKV(self.k_cache(layer), self.v_cache(layer), scales)

    def copy_slots(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Every layer's K and V (and scales) of slots `src` into slots `dst`."""
        dim = 2 if self.head_major else 1
        to, frm = torch.from_numpy(dst), torch.from_numpy(src)
        for tensor in (self.k, self.v, self.k_scales, self.v_scales):
            if tensor is not None:
                tensor.index_copy_(dim, to, tensor.index_select(dim, frm))


def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One token's K and V in every layer of a pool of `dtype`, an int8 pool's scales included
    (two bfloat16 bytes per row)."""
    element = torch.empty(0, dtype=dtype).element_size()
    row = head_dim * element + (2 if dtype == torch.int8 else 0)
    return 2 * num_layers * num_kv_heads * row


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeros for a pool tensor: on CPU on huge pages where Linux allows (see radixlm.hugepages)."""
    if torch.device(device).type == "cpu":
        return hugepages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
