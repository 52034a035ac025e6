"""The scheduler's longest-prefix-first order counts what a request will load from L2: a prefix
on disk is not a miss. `peek` predicts exactly what `match` then returns, L2 included."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch
from engine_helpers import GREEDY
from tiny_tokenizers import byte_level

from radixlm.cache.kv_pool import KVPool
from radixlm.cache.l2.cache import TieredRadixCache, make_tiered_cache
from radixlm.cache.l2.extent_file import ExtentFile, Faults
from radixlm.cache.l2.node import EXTENT_TOKENS
from radixlm.cache.l2.store import fingerprint
from radixlm.config import SchedulerConfig
from radixlm.engine.request import Request
from radixlm.engine.scheduler import Scheduler

ON_DISK = np.arange(3 * EXTENT_TOKENS, dtype=np.int64)  # three extents, evicted to L2
IN_RAM = np.arange(5000, 5000 + EXTENT_TOKENS, dtype=np.int64)  # one extent, kept in RAM


def make_cache(tmp_path: Path) -> TieredRadixCache:
    pool = KVPool(1024, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    l2 = ExtentFile(str(tmp_path / "l2"), 8, EXTENT_TOKENS * pool.bytes_per_slot, fingerprint(pool))
    cache = make_tiered_cache(pool, l2)
    for tokens in (ON_DISK, IN_RAM):
        cache.tree.insert(tokens, cache.alloc(len(tokens)))
        cache.num_in_flight -= len(tokens)  # tree-owned now
        cache.tree.match(tokens)  # a hit: worth keeping on L2
        if tokens is ON_DISK:
            cache.flush()
    return cache


def request(rid: str, prompt: np.ndarray) -> Request:
    return Request(rid, [*prompt.tolist(), 7, 8, 9], GREEDY, byte_level())


def test_a_prefix_on_disk_ranks_by_the_tokens_it_will_load(tmp_path: Path) -> None:
    cache = make_cache(tmp_path)
    assert cache.tree.peek(ON_DISK) == 0 and cache.tree.num_l2_extents == 3
    sched = Scheduler(SchedulerConfig(max_running_requests=1), cache)
    in_ram, on_disk = request("ram", IN_RAM), request("disk", ON_DISK)
    sched.add([in_ram])
    sched.add([on_disk])  # arrives second, but has 3 extents to load against 1 extent in RAM
    assert sched._waiting_order() == [on_disk, in_ram]
    disk = threading.Event()

    def slow(extent: int) -> None:
        disk.wait(10.0)

    cache.store.file.faults = Faults(read=slow)
    step = sched.schedule()  # its load starts first; the one running slot goes to the RAM hit
    assert id(on_disk) in sched._loads and sched.running == [in_ram]
    sched.cancel(step.scheduled)  # no forward pass here: the step's slots go back
    disk.set()
    for req in (on_disk, in_ram):
        sched.remove(req)
    cache.check_integrity()
    assert cache.num_in_flight == 0


def test_peek_predicts_the_match_l2_included(tmp_path: Path) -> None:
    cache = make_cache(tmp_path)
    queries = [
        np.concatenate([ON_DISK, [1, 2]]),
        np.concatenate([ON_DISK[:100], [9999] * 50]),  # diverges inside the L2 edge: 1 extent
        IN_RAM[:40],
        np.concatenate([IN_RAM, ON_DISK]),  # RAM prefix, no L2 continuation
    ]
    for query in queries:
        predicted = cache.peek(query)
        assert cache.match(query).length == predicted
        cache.check_integrity()
    assert [cache.peek(q) for q in queries] == [192, 100, 40, 64]  # the first load is in RAM
