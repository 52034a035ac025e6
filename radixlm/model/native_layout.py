"""What the native kernels take besides tensors: the batch layouts (which request reads which
slots, as int64 tables the C code walks), the decoder's shape, and the packed weight layout of
skinny_linear. Built in Python once per step (layouts) or per model (shape, packed weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm import hugepages

# the float dtypes the kernels read and compute in: of models, activations and float pools
KV_DTYPES = (torch.float32, torch.bfloat16)
POOL_DTYPES = (*KV_DTYPES, torch.int8)  # pool dtypes the kernels read (int8: with scales)


@dataclass(frozen=True)
class DecoderShape:
    """What decode_layers needs to know of the model besides its weights."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


class ExtendLayout:
    """Requests with new tokens for the extend kernel: per span, its first row among the T new
    tokens, extend_len, prefix_len, and where its prefix_len + extend_len slots start in `slots`.
    """

    def __init__(self, spans: list[tuple[int, int, int, torch.Tensor]]):
        """spans: (first row, extend_len, prefix_len, all of the request's slots)."""
        rows, offset = [], 0
        for first, extend_len, prefix_len, slots in spans:
            rows.append((first, extend_len, prefix_len, offset))
            offset += len(slots)
        self.num_spans = len(spans)
        self.spans = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
        self.slots = torch.cat([s for *_, s in spans]).to(torch.int64).cpu()
        self.pointers = (self.spans.data_ptr(), self.slots.data_ptr())  # alive with the tensors


class DecodeLayout:
    """The decode batch as units for the kernel: each group of requests sharing a leading run of
    slots is one unit (the run read once for all), every other request a unit of its own.

    groups: (member indices, shared run length) as found by shared_prefix.find_shared_prefixes.
    """

    def __init__(self, slot_lists: list[torch.Tensor], groups: list[tuple[list[int], int]]):
        grouped = {i for members, _ in groups for i in members}
        units = [(members, length) for members, length in groups]
        units += [([i], 0) for i in range(len(slot_lists)) if i not in grouped]
        pieces: list[torch.Tensor] = []
        offset = 0
        unit_starts, shared, own, member_row = [0], [], [], []
        for members, length in units:
            if length:
                pieces.append(slot_lists[members[0]][:length])
            shared.append((offset, length))
            offset += length
            for i in members:
                mine = slot_lists[i][length:]
                pieces.append(mine)
                own.append((offset, len(mine)))
                offset += len(mine)
                member_row.append(i)
            unit_starts.append(len(member_row))
        self.num_units = len(units)
        self.units = torch.tensor(unit_starts, dtype=torch.int64)
        self.shared = torch.tensor(shared, dtype=torch.int64).reshape(-1, 2)
        self.own = torch.tensor(own, dtype=torch.int64).reshape(-1, 2)
        self.member_row = torch.tensor(member_row, dtype=torch.int64)
        self.slots = torch.cat(pieces).to(torch.int64).cpu()
        arrays = (self.units, self.shared, self.own, self.member_row, self.slots)
        self.pointers = tuple(a.data_ptr() for a in arrays)  # kept alive by the attributes


def can_pack_skinny(weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes this (out, in) weight: float32 or bfloat16 on the CPU, out a
    multiple of 16, in even."""
    n, k = weight.shape
    return weight.dtype in KV_DTYPES and weight.device.type == "cpu" and not n % 16 and not k % 2


def pack_skinny(weight: torch.Tensor, arena: hugepages.Arena | None = None) -> torch.Tensor | None:
    """A dense (out, in) weight in skinny_linear's layout: blocks of 16 output columns, k-major
    inside (float32 (out/16, in, 16); bfloat16 (out/16, in/2, 16, 2)), in a tensor of its own
    or taken from `arena`. None where the kernel does not apply (see can_pack_skinny)."""
    if not can_pack_skinny(weight):
        return None
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.float32:
        packed = w.reshape(n // 16, 16, k).transpose(1, 2)
    else:
        packed = w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    if arena is None:
        return packed.contiguous()
    return arena.take(tuple(packed.shape), packed.dtype).copy_(packed)


def kv_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(slot, head) strides in elements of a pool layer's K and V views (num_slots, kv, D): the
    kernels take any layout whose head rows are contiguous and disjoint, as long as K and V
    share it (KVPool's CPU pools are head-major, (kv, num_slots, D) underneath)."""
    num_slots, num_kv_heads, head_dim = k_cache.shape
    strides = k_cache.stride()
    if v_cache.shape != k_cache.shape or v_cache.stride() != strides or strides[2] != 1:
        raise ValueError(f"K/V pool views of strides {strides} and {v_cache.stride()}")
    slot, head = strides[0], strides[1]
    if (slot, head) not in ((num_kv_heads * head_dim, head_dim), (head_dim, num_slots * head_dim)):
        raise ValueError(f"K/V pool views must be slot- or head-major: strides {strides}")
    return slot, head


def scale_strides(
    k_cache: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor
) -> tuple[int, int]:
    """(slot, head) strides in elements of an int8 pool layer's scale views (num_slots, kv),
    bfloat16, laid out as its codes are (KVPool): slot- or head-major, K and V alike."""
    num_slots, num_kv_heads, _ = k_cache.shape
    strides = k_scales.stride()
    if k_scales.shape != (num_slots, num_kv_heads) or v_scales.shape != k_scales.shape:
        raise ValueError(f"scales shaped {tuple(k_scales.shape)} for K/V {tuple(k_cache.shape)}")
    if {k_scales.dtype, v_scales.dtype} != {torch.bfloat16} or v_scales.stride() != strides:
        raise ValueError("int8 K/V scales must be bfloat16 views laid out alike")
    if strides not in ((num_kv_heads, 1), (1, num_slots)):
        raise ValueError(f"scale views must be slot- or head-major: strides {strides}")
    return strides[0], strides[1]
