"""Belady's clairvoyant eviction over a request trace: the hit rate no online policy can beat
(up to the sizes of what it evicts), the far end of the LRU -> Belady gap that `bench cache`
reports.

The cache holds *units*: a sequence is cut into blocks of `block` tokens (the last one may be
shorter) and a unit is the prefix ending at a block boundary, keyed by a hash chained over the
blocks, so two sequences share a unit iff they share that whole prefix. A prompt hits the
leading units that are cached. When full, the unit whose next use by a prompt lies farthest in
the future goes first; a unit is never used later than its parent (a prompt that needs it needs
the parent), and on a tie the deeper goes first, so the cache stays prefix-closed. The request
being served is pinned, as the tree pins it.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from itertools import pairwise
from typing import NamedTuple

from radixlm.bench.traces import TraceRequest

NEVER = 1 << 62  # the next use of a unit that no later prompt needs


class BeladyResult(NamedTuple):
    hit_tokens: int  # over the requests from `eval_start` on
    prompt_tokens: int


def belady(
    requests: list[TraceRequest], capacity: int, block: int = 512, eval_start: int = 0
) -> BeladyResult:
    """Replay `requests` with clairvoyant eviction at `capacity` tokens (see the module)."""
    units = [_units(r, block) for r in requests]  # per request: (key, size, in_prompt) in order
    uses: dict[int, list[int]] = defaultdict(list)  # key -> request indices whose prompt needs it
    for i, request_units in enumerate(units):
        for key, _, in_prompt in request_units:
            if in_prompt:
                uses[key].append(i)
    cursor: dict[int, int] = defaultdict(int)  # key -> index into uses[key] of its next use
    cached: dict[int, tuple[int, int]] = {}  # key -> (size, depth in units)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    used = hits = prompt_tokens = 0
    for i, request_units in enumerate(units):
        hit, missing = 0, False
        for depth, (key, size, in_prompt) in enumerate(request_units):
            if in_prompt:
                if not missing and key in cached:
                    hit += size
                else:
                    missing = True
            if key not in cached:
                cached[key] = (size, depth)
                used += size
            nxt = _next_use(uses[key], cursor, key, i)
            heapq.heappush(heap, (-nxt, -depth, key))
        if i >= eval_start:
            hits += hit
            prompt_tokens += requests[i].prompt_len
        pinned = {key for key, _, _ in request_units}
        held: list[tuple[int, int, int]] = []
        while used > capacity and heap:
            entry = heapq.heappop(heap)
            neg_next, _, key = entry
            if key not in cached or -neg_next != _next_use(uses[key], cursor, key, i):
                continue  # stale: evicted, or its next use moved on
            if key in pinned:
                held.append(entry)
                continue
            used -= cached.pop(key)[0]
        for entry in held:
            heapq.heappush(heap, entry)
        if len(heap) > 4 * len(cached) + 1024:  # drop stale entries in bulk: amortised O(1)
            heap = [(-_next_use(uses[k], cursor, k, i), -cached[k][1], k) for k in cached]
            heapq.heapify(heap)
    return BeladyResult(hits, prompt_tokens)


def _next_use(key_uses: list[int], cursor: dict[int, int], key: int, now: int) -> int:
    """The first request after `now` whose prompt needs `key` (NEVER if none)."""
    j = cursor[key]
    while j < len(key_uses) and key_uses[j] <= now:
        j += 1
    cursor[key] = j
    return key_uses[j] if j < len(key_uses) else NEVER


def _units(request: TraceRequest, block: int) -> list[tuple[int, int, bool]]:
    """(chained key, size, in the prompt) per unit: the prompt in blocks (the last one may be
    shorter), then the output in blocks, so that no unit straddles the prompt's end."""
    full, plen = request.full, request.prompt_len
    bounds = [*range(0, plen, block), *range(plen, len(full), block), len(full)]
    out, key = [], 0
    for start, end in pairwise(bounds):
        key = hash((key, full[start:end].tobytes()))
        out.append((key, end - start, end <= plen))
    return out
