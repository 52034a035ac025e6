"""The served L2 tier on a tiny model: with a pool so small that a conversation's KV leaves RAM
between its turns, its extents go to disk and come back, and greedy outputs are identical with L2
on, L2 off and the cache off; a corrupted extent file is recomputed, never served."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from engine_helpers import GREEDY, assert_idle, outputs, run, save_engine_model

from radixlm.cache.l2.cache import TieredRadixCache
from radixlm.cache.l2.extent_file import Faults
from radixlm.config import CacheConfig, CacheKind, KVDType, ModelConfig, SchedulerConfig
from radixlm.engine.engine import Engine
from radixlm.server.metrics import ServerMetrics
from radixlm.server.snapshot import take_snapshot

NUM_SLOTS = 400  # one conversation (~330 tokens at its third turn) and little else


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("l2-model")
    save_engine_model(path)
    return path


def engine(
    model_dir: Path,
    cache: CacheKind = "radix",
    l2_dir: Path | None = None,
    l2_capacity: int = 4096,
    kv_dtype: KVDType | None = None,
) -> Engine:
    return Engine(
        ModelConfig(path=str(model_dir), dtype="float32", num_threads=1),
        CacheConfig(
            num_slots=NUM_SLOTS,
            cache=cache,
            l2_dir=None if l2_dir is None else str(l2_dir),
            l2_capacity=l2_capacity,
            kv_dtype=kv_dtype,
        ),
        SchedulerConfig(),
    )


def script(eng: Engine, corrupt: Path | None = None) -> list[list[int]]:
    """Conversation A for three turns with fillers between its turns, each filler big enough
    to push A out of the pool; returns every output. `corrupt`: the extent file to scribble over
    before the third turn."""
    rng = random.Random(7)
    words = lambda n: [rng.randrange(1, 250) for _ in range(n)]  # noqa: E731
    fillers = [words(300) for _ in range(2)]
    prompt, outs = words(120), []
    for turn in range(3):
        out = outputs(run(eng, [prompt]))[0]
        outs.append(out)
        outs.append(outputs(run(eng, [fillers[turn % 2]]))[0])
        if turn == 1 and corrupt is not None:  # every extent written so far
            with open(corrupt, "r+b") as f:
                f.write(os.urandom(os.path.getsize(corrupt)))
        prompt = prompt + out + words(40)
    return outs


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return script(engine(model_dir, cache="none"))


def test_extents_go_to_disk_and_come_back_with_identical_outputs(
    model_dir: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    assert script(engine(model_dir)) == reference
    tiered = engine(model_dir, l2_dir=tmp_path)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    assert script(tiered) == reference
    assert cache.store.written_extents > 0 and cache.loads.hit_tokens >= 128  # turn 3 read turn 2's
    assert cache.loads.bad_extents == 0
    assert_idle(tiered)  # check_integrity: slots and the extent account
    snapshot = take_snapshot(tiered)  # what /v1/cache and /metrics show
    l2 = snapshot.to_dict()["l2"]
    assert l2["hit_tokens"] == cache.loads.hit_tokens and l2["written_bytes"] > 0
    assert l2["num_free_extents"] + l2["num_tree_extents"] == l2["num_extents"]
    text = ServerMetrics().render(snapshot).decode()
    assert f"radixlm_l2_hit_tokens_total {float(cache.loads.hit_tokens)}" in text
    assert f"radixlm_l2_load_seconds_count {float(cache.loads.num_loads)}" in text
    assert "radixlm_l2_rejected_tokens_total" in text and 'radixlm_l2_pages{state="free"}' in text


def test_int8_extents_go_to_disk_and_come_back_with_identical_outputs(
    model_dir: Path, tmp_path: Path
) -> None:
    """An int8 pool's extents (codes and scales) leave RAM and come back: greedy outputs equal
    the int8 pool's with the cache off, and every slot and extent is accounted for."""
    expected = script(engine(model_dir, cache="none", kv_dtype="int8"))
    tiered = engine(model_dir, l2_dir=tmp_path, kv_dtype="int8")
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache) and tiered.runner.pool.quantized
    assert script(tiered) == expected
    assert cache.store.written_extents > 0 and cache.loads.hit_tokens >= 128
    assert cache.loads.bad_extents == 0
    assert_idle(tiered)


def test_a_full_l2_keeps_outputs_identical(
    model_dir: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    tiered = engine(model_dir, l2_dir=tmp_path, l2_capacity=2 * 64)  # fewer pages than spilled
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    assert script(tiered) == reference
    assert cache.store.written_extents >= 2 and cache.store.file.num_free == 0
    assert cache.loads.hit_tokens >= 64  # the chain's head stayed: turn 3 still loads a prefix
    assert_idle(tiered)


def test_a_corrupted_extent_file_is_recomputed(
    model_dir: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    tiered = engine(model_dir, l2_dir=tmp_path)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    seen = []  # (loads counted, hit tokens) as each read starts: before its load is counted

    def before_read(extent: int) -> None:
        seen.append((cache.loads.num_loads, cache.loads.hit_tokens))

    cache.store.file.faults = Faults(read=before_read)
    assert script(tiered, corrupt=tmp_path / "l2.extents") == reference
    # the last load ran after the corruption: it found a bad extent first and loaded nothing
    hits_before = [hits for loads, hits in seen if loads == cache.loads.num_loads - 1]
    assert cache.loads.bad_extents > 0 and cache.loads.hit_tokens == hits_before[0]
    assert_idle(tiered)


def test_an_unusable_l2_directory_runs_without_l2(model_dir: Path, tmp_path: Path) -> None:
    eng = engine(model_dir, l2_dir=tmp_path / "missing")
    assert not isinstance(eng.cache, TieredRadixCache)
    assert outputs(run(eng, [[5, 6, 7]]))


def test_a_full_disk_is_logged_and_recomputed(
    model_dir: Path, tmp_path: Path, reference: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    tiered = engine(model_dir, l2_dir=tmp_path)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)

    def full(extent: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    cache.store.file.faults = Faults(write=full)
    with caplog.at_level(logging.WARNING):
        assert script(tiered) == reference
    assert (
        cache.store.written_extents > 0
        and cache.loads.bad_extents > 0
        and cache.loads.hit_tokens == 0
    )
    assert "L2 extent write failed" in caplog.text
    assert_idle(tiered)


def on_disk(model_dir: Path, tmp_path: Path) -> tuple[Engine, list[int], threading.Event]:
    """An L2 engine whose two-turn conversation left RAM for disk, reads from which wait for
    the returned event; the conversation's next prompt."""
    rng = random.Random(11)
    words = lambda n: [rng.randrange(1, 250) for _ in range(n)]  # noqa: E731
    first, filler = words(120), words(330)
    tiered = engine(model_dir, l2_dir=tmp_path)
    second = first + outputs(run(tiered, [first]))[0] + words(30)
    follow = second + outputs(run(tiered, [second]))[0] + words(30)  # a second turn: kept
    run(tiered, [filler])  # the conversation's KV leaves RAM for the extent file
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    disk = threading.Event()

    def slow(extent: int) -> None:
        disk.wait(10.0)

    cache.store.file.faults = Faults(read=slow)
    return tiered, follow, disk


def test_other_requests_compute_while_a_prefix_loads_from_disk(
    model_dir: Path, tmp_path: Path
) -> None:
    tiered, follow, disk = on_disk(model_dir, tmp_path)
    short = list(range(3, 23))
    expected = outputs(run(engine(model_dir, cache="none"), [follow, short]))
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    hits = cache.loads.hit_tokens
    samples = [tiered.requests(tiered.add_request(p, GREEDY))[0] for p in (follow, short)]
    while not samples[1].finished:
        tiered.step()  # the short request runs to its end while the follow-up waits for disk
    assert samples[0].first_token_time is None and samples[0].computed_len == 0
    disk.set()
    while tiered.has_unfinished():
        tiered.step()
    assert [s.output_ids for s in samples] == expected
    assert cache.loads.hit_tokens - hits >= 128 and cache.loads.read_timeouts == 0
    assert_idle(tiered)


def test_a_request_aborted_while_its_prefix_loads_gives_everything_back(
    model_dir: Path, tmp_path: Path
) -> None:
    tiered, follow, disk = on_disk(model_dir, tmp_path)
    rid = tiered.add_request(follow, GREEDY)
    tiered.step()
    assert tiered.cache.num_in_flight > 0  # the load's slots
    threading.Timer(0.2, disk.set).start()  # the abort waits for the reads it started
    tiered.abort(rid)
    assert_idle(tiered)


def test_while_the_disk_has_room_what_ram_evicts_is_written_and_loads_back(
    model_dir: Path, tmp_path: Path
) -> None:
    """While L2 has free extents, what RAM will evict is written whatever the write filter says
    (one-shot first turns included): through, as each request finishes, so the copy is made off
    the engine thread; a later request with the same prompt loads it."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 250) for _ in range(150)] for _ in range(6)]
    tiered = engine(model_dir, l2_dir=tmp_path)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    for prompt in prompts:  # 6 x 162 tokens through 400 slots: most are evicted
        run(tiered, [prompt])
    # first turns only (the filter wants none): every path written through, nothing at eviction
    assert cache.store.written_extents == cache.store.through_extents >= 6 * 2
    assert cache.tree.l2_rejected_tokens == 0
    assert cache.tree.match(prompts[0]).length == 0  # it left RAM: it is on disk only
    expected = outputs(run(engine(model_dir, cache="none"), [prompts[0]]))
    assert outputs(run(tiered, [prompts[0]])) == expected
    assert cache.loads.hit_tokens >= 128 and cache.loads.bad_extents == 0
    assert_idle(tiered)


def test_a_full_disk_writes_only_what_the_filter_wants(model_dir: Path, tmp_path: Path) -> None:
    """Once L2 has no free extents, a one-shot first turn RAM evicts is not written (counted in
    `l2_rejected_tokens`) and displaces nothing, while a later turn is still written, evicting
    L2's least recently used leaves."""
    rng = random.Random(5)
    words = lambda n: [rng.randrange(1, 250) for _ in range(n)]  # noqa: E731
    plain = engine(model_dir, cache="none")
    tiered = engine(model_dir, l2_dir=tmp_path, l2_capacity=9 * 64)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    first = words(120)
    second = first + outputs(run(tiered, [first]))[0] + words(30)
    third = second + outputs(run(tiered, [second]))[0] + words(20)
    for _ in range(8):  # one-shot first turns, written while the disk has room for them
        if cache.store.num_free_extents < 3:
            break
        run(tiered, [words(150)])
    assert cache.store.num_free_extents < 3 and cache.tree.l2_rejected_tokens == 0
    written, free = cache.store.written_extents, cache.store.num_free_extents
    run(tiered, [words(150)])  # no room for its 3 extents: the filter refuses a first turn
    for _ in range(2):
        run(tiered, [words(150)])  # and RAM evicting it writes nothing either
    assert cache.store.written_extents == written and cache.store.num_free_extents == free
    assert cache.tree.l2_rejected_tokens >= 150 and cache.tree.l2_evicted_extents == 0
    assert cache.tree.peek_tiers(third) == len(second) + 11  # the conversation is kept whole
    hits = cache.loads.hit_tokens
    assert outputs(run(tiered, [third])) == outputs(run(plain, [third]))
    assert cache.loads.hit_tokens - hits == len(second) + 11
    # A second turn of another conversation is written through, into a full disk: the least
    # recently used one-shot extents make room for it.
    other = words(120)
    other_second = other + outputs(run(tiered, [other]))[0] + words(30)
    through, evicted = cache.store.through_extents, cache.tree.l2_evicted_extents
    assert outputs(run(tiered, [other_second])) == outputs(run(plain, [other_second]))
    # a response continues its own request's turn: the next prompt is turn 2
    m = cache.tree.match(other_second)
    assert m.node.turn == 2 and m.node.parent is not None and m.node.parent.turn == 1
    assert cache.store.through_extents - through == 3
    assert cache.tree.l2_evicted_extents - evicted >= 3
    assert_idle(tiered)


def test_in_memory_retention_is_never_written_even_with_room(
    model_dir: Path, tmp_path: Path
) -> None:
    """`prompt_cache_retention: in_memory` keeps a request's KV off the disk even while L2 has
    free extents; a default request evicted beside it is written."""
    rng = random.Random(13)
    ram_only, default, filler = ([rng.randrange(1, 250) for _ in range(n)] for n in (150, 150, 380))
    in_memory = dataclasses.replace(GREEDY, cache_retention="in_memory")
    tiered = engine(model_dir, l2_dir=tmp_path)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    run(tiered, [ram_only], in_memory)
    run(tiered, [default])
    run(tiered, [filler], in_memory)  # evicts both from RAM
    assert cache.tree.match(ram_only).length == cache.tree.match(default).length == 0
    assert cache.tree.peek_tiers(ram_only) == 0 and cache.tree.peek_tiers(default) >= 128
    assert cache.store.written_extents == 3  # the default request's 0..128, then 128..161
    assert cache.tree.l2_rejected_tokens >= len(ram_only)
    assert cache.store.num_free_extents > 3
    assert_idle(tiered)


def test_a_finished_turn_is_written_through_and_leaves_ram_without_a_write(
    model_dir: Path, tmp_path: Path
) -> None:
    plain = engine(model_dir, cache="none")
    tiered, cache, second, filler, words = _second_turn(model_dir, tmp_path, seed=17)
    assert outputs(run(tiered, [second])) == outputs(run(plain, [second]))
    through = cache.store.through_extents  # the second turn's path, written as it finished
    assert through >= (len(second) + 11) // 64 and cache.store.written_extents == through
    cache.store.wait_writes()  # the I/O threads copied every extent (as while others run)
    live = cache.tree.num_l2_extents  # the first turn's tail extent went to its continuation
    ram_only = dataclasses.replace(GREEDY, cache_retention="in_memory")  # the filler stays off
    run(tiered, [filler], ram_only)  # RAM evicts the conversation: its slots go, no write
    assert cache.store.written_extents == through and cache.store.settled_extents == 0
    assert cache.tree.num_l2_nodes > 0 and cache.tree.match(second).length == 0
    third = second + words(20)
    assert outputs(run(tiered, [third])) == outputs(run(plain, [third]))
    assert cache.loads.hit_tokens >= live * 64 - 64  # all but an extent the filler's pass took
    assert_idle(tiered)


def test_aborts_and_evictions_while_a_write_through_waits_for_the_disk(
    model_dir: Path, tmp_path: Path
) -> None:
    tiered, cache, second, filler, _ = _second_turn(model_dir, tmp_path, seed=19)
    disk = threading.Event()

    def slow(extent: int) -> None:
        disk.wait(10.0)  # before the staged payload is gathered: nothing is copied yet

    cache.store.file.faults = Faults(write=slow)
    rid = tiered.add_request(second, GREEDY)
    for _ in range(3):
        tiered.step()
    tiered.abort(rid)  # a second turn, aborted while decoding: its path is written through
    assert cache.store.through_extents > 0
    assert_idle(tiered)
    rid = tiered.add_request(filler, GREEDY)
    tiered.step()  # the filler's admission evicts the conversation: no extent was copied yet
    assert cache.store.settled_extents > 0  # so eviction copied them before freeing the slots
    tiered.abort(rid)
    assert_idle(tiered)
    disk.set()
    expected = outputs(run(engine(model_dir, cache="none"), [second]))
    hits = cache.loads.hit_tokens
    assert outputs(run(tiered, [second])) == expected
    assert cache.loads.hit_tokens - hits >= 128 and cache.loads.bad_extents == 0
    assert_idle(tiered)


class SecondTurn(NamedTuple):
    tiered: Engine
    cache: TieredRadixCache
    second: list[int]  # the second turn's prompt: turn one, its output, 30 new tokens
    filler: list[int]  # a 330-token prompt that evicts the conversation from 400 slots
    words: Callable[[int], list[int]]  # more random tokens from the same stream


def _second_turn(model_dir: Path, tmp_path: Path, seed: int) -> SecondTurn:
    """An engine with L2 that has run a 120-token first turn, and the second turn's prompt."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(1, 250) for _ in range(n)]  # noqa: E731
    first, filler = words(120), words(330)
    tiered = engine(model_dir, l2_dir=tmp_path)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    second = first + outputs(run(tiered, [first]))[0] + words(30)
    return SecondTurn(tiered, cache, second, filler, words)


def test_prompt_cache_retention_decides_what_reaches_the_disk(
    model_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(9)
    first, second = ([rng.randrange(1, 250) for _ in range(150)] for _ in range(2))
    plain = engine(model_dir, cache="none")
    tiered = engine(model_dir, l2_dir=tmp_path)
    cache = tiered.cache
    assert isinstance(cache, TieredRadixCache)
    keep = dataclasses.replace(GREEDY, cache_retention="24h")
    ram_only = dataclasses.replace(GREEDY, cache_retention="in_memory")
    # A first turn is not worth writing by default; "24h" writes it through as it finishes.
    [out_first] = outputs(run(tiered, [first], keep))
    assert [out_first] == outputs(run(plain, [first]))
    assert cache.store.through_extents == cache.tree.num_l2_extents == 3  # 0..128, then 128..161
    # "in_memory": nothing of it reaches the disk, not even a later turn that continues it,
    # which would be written (turn 2) were it not below a RAM-only node.
    written = cache.store.written_extents
    out = outputs(run(tiered, [second], ram_only))[0]
    later = second + out + [rng.randrange(1, 250) for _ in range(30)]
    assert outputs(run(tiered, [later])) == outputs(run(plain, [later]))
    assert cache.tree.match(later).node.turn == 2
    run(tiered, [[rng.randrange(1, 250) for _ in range(380)]], ram_only)  # evicts both from RAM
    assert cache.store.written_extents == written and cache.tree.peek_tiers(later) == 0
    # The first conversation comes back from disk, its tail extent too.
    again = first + out_first + [rng.randrange(1, 250) for _ in range(10)]
    assert cache.tree.peek_tiers(again) == len(first) + len(out_first) - 1
    assert outputs(run(tiered, [again])) == outputs(run(plain, [again]))
    assert_idle(tiered)
