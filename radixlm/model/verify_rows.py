"""Verify rows: what lets one forward check a draft and still give every row the bits of the
decode step it stands for, and how a verify chain is laid out for the native decode kernel.

Greedy output must be token for token the same with speculation on and off, so the logits of
verify row j (the request's tokens up to draft token j) must equal, bit for bit, those a decode
step over the same tokens gives. What a decode row's bits depend on (tests/test_verify_rows.py
holds each rule on every kernel variant the CPU executes):

  matmuls     quantized blocks: one accumulation order at any row count. skinny_linear on
              packed float weights: one accumulator per output, k in order, up to
              SKINNY_EXACT_ROWS rows (the avx2 build's bfloat16 panels differ past 96). oneDNN
              and F.linear (the PyTorch route: a float model's LM head that skinny_linear cannot
              pack, the generic build's matmuls past 16 rows) choose kernels by shape, so a row's
              bits depend on the rows beside it.
  attention   the extend kernel's tiles over query rows are not the decode kernel's arithmetic,
              so a draft is verified as decode rows (ForwardBatch.build(verify=...)). In the
              decode kernel (csrc/decode_task.h) each query row walks its keys in segments of
              256 by position in its sequence (merged in order), each in chunks with an
              online-softmax update per chunk: 16 keys (attend_rows, AVX-512) or KEY_CHUNK
              (attend_keys). A unit of fewer than TILE_MIN_ROWS query rows runs row by row, each
              row's arithmetic its own; from TILE_MIN_ROWS rows a unit's shared run goes through
              the register tiles, other bits. So rows on a common prefix (requests on one cached
              prompt, the rows of one chain) may share its run up to a multiple of KEY_CHUNK
              (where a lone row's chunks end too), read once per unit of fewer than
              TILE_MIN_ROWS query rows, and still get a lone row's bits: `decode_units` lays
              every decode row out so, and a decode step gives a row the same bits alone or
              batched (whatever the batch shares), which greedy identity across speculation on
              and off needs, since the two modes batch differently over time.
  the rest    embeddings, rope + K/V store, norms, SiLU: row by row.

`exact_rows(model, pool)` is the most rows a step may carry while every row keeps the bits it
has alone (1 where nothing is promised: the PyTorch path, whose SDPA runs over padded batches).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from radixlm.cache.kv_pool import KVPool
from radixlm.model import native
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.shared_prefix import find_shared_prefixes

if TYPE_CHECKING:
    from radixlm.model.transformer import CausalLM

KEY_CHUNK = 32  # decode_task.h CHUNK (keys per softmax update); a multiple of attend_rows' 16
TILE_MIN_ROWS = 16  # decode_task.h TILE_MIN_ROWS: query rows from which a shared run is tiled
SKINNY_EXACT_ROWS = native.NATIVE_LINEAR_ROWS  # skinny_linear: a row's bits at up to 64 rows
UNBOUNDED = sys.maxsize


def decode_units(
    batch: ForwardBatch, members: list[int], query_group: int
) -> list[tuple[list[int], int]]:
    """The decode kernel's groups (member positions, shared run length) for the decode rows
    `members` (batch indices, in order) of `batch`, whose heads come `query_group` query heads
    per KV head: each verify chain's rows on their prefix, the other rows on the runs
    find_shared_prefixes finds, all in `exact_units` (each row keeps its lone bits)."""
    position = {row: p for p, row in enumerate(members)}
    units: list[tuple[list[int], int]] = []
    in_chain: set[int] = set()
    for chain in batch.chains:
        rows = [position[r] for r in range(chain.first, chain.first + chain.num_rows)]
        in_chain.update(rows)
        units += exact_units(rows, chain.prefix_len, query_group)
    others = [p for p in range(len(members)) if p not in in_chain]
    for group, length in find_shared_prefixes([batch.seq_slots[members[p]] for p in others]):
        units += exact_units([others[i] for i in group], length, query_group)
    return units


def exact_units(rows: list[int], run_len: int, query_group: int) -> list[tuple[list[int], int]]:
    """Rows (member positions) on a common run of `run_len` slots, in units that read its first
    run_len // KEY_CHUNK * KEY_CHUNK slots once each and run row by row (fewer than
    TILE_MIN_ROWS query rows each); no units where no run or no pair of rows fits."""
    run = run_len // KEY_CHUNK * KEY_CHUNK
    per_unit = (TILE_MIN_ROWS - 1) // query_group
    if run == 0 or per_unit < 2 or len(rows) < 2:
        return []  # each row its own unit: a lone decode
    return [(rows[i : i + per_unit], run) for i in range(0, len(rows), per_unit)]


def exact_rows(model: CausalLM, pool: KVPool) -> int:
    """How many rows a forward of `model` over `pool` may carry while each row gets the bits it
    gets alone (see the module docstring); 1 where no row count is promised."""
    backend = model.backend.for_pool(pool)
    if backend.kernels is None:
        return 1
    from radixlm.model.transformer import Linear  # transformer imports attention, which imports us

    dtype = model.model.embed_tokens.weight.dtype
    bound = UNBOUNDED
    for linear in (m for m in model.modules() if isinstance(m, Linear)):
        if linear.quant is not None:
            continue
        if linear.skinny is None or linear.skinny.dtype != dtype:
            return 1  # the PyTorch route at every row count
        bound = min(bound, backend.native_linear_rows, SKINNY_EXACT_ROWS)
    return bound
