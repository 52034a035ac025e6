"""`bench cache` with a simulated L2 tier and Belady: hits per tier, bytes, the write filter,
the eval window, and Belady against LRU and a brute-force optimum on small traces."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.bench.belady import belady
from radixlm.bench.cache_replay import replay
from radixlm.bench.l2_sim import KV_BYTES_PER_TOKEN
from radixlm.bench.traces import TraceRequest
from radixlm.cli import main

SYS = list(range(1000, 1016))


def request(prompt: list[int], output: Sequence[int] = ()) -> TraceRequest:
    return TraceRequest(np.array([*prompt, *output], dtype=np.int64), len(prompt))


def turn(seed: int, n: int) -> list[int]:
    return SYS + [seed * 100 + i for i in range(20 * n)]


def filler(seed: int) -> TraceRequest:
    return request([5000 + seed * 100 + i for i in range(60)])


def test_a_later_turn_comes_back_from_l2_and_a_first_turn_is_not_written() -> None:
    # conversation 1: turns 1 and 2, pushed out of a 100-token L1 by fillers, then turn 3
    trace = [request(turn(1, 1)), request(turn(1, 2)), filler(1), filler(2), request(turn(1, 3))]
    ram = replay(trace, capacity=100, eval_start=4).summary()
    tiered = replay(
        trace, capacity=100, l2_capacity=1000, eval_start=4, l2_write="filter"
    ).summary()
    assert ram["eval_token_hit_rate"] == tiered["eval_l1_hit_rate"] == 0.0
    # turn 2's whole path (56 tokens) was written as it finished; turn 1 alone was not
    assert tiered["eval_l2_hit_tokens"] == len(turn(1, 2))
    assert tiered["l2_bytes_read"] == len(turn(1, 2)) * KV_BYTES_PER_TOKEN
    assert tiered["l2_bytes_written"] >= tiered["l2_bytes_read"]
    assert tiered["l2_rejected_tokens"] > 0  # the fillers and turn 1 (first turns, no hits)
    assert tiered["eval_token_hit_rate"] == round(len(turn(1, 2)) / len(turn(1, 3)), 4)


def test_a_finished_turn_is_written_through_and_its_eviction_writes_nothing() -> None:
    done = replay([request(turn(1, 1)), request(turn(1, 2))], l2_capacity=1000)
    assert done.l2 is not None and done.l2.tree.num_tokens == len(turn(1, 2))  # no eviction yet
    trace = [request(turn(1, 1)), request(turn(1, 2)), filler(1), filler(2)]
    s = replay(trace, capacity=100, l2_capacity=1000, l2_write="filter").summary()
    assert s["evicted_tokens"] >= len(turn(1, 2))  # L1 dropped the conversation...
    assert s["l2_bytes_written"] == len(turn(1, 2)) * KV_BYTES_PER_TOKEN  # ...and wrote nothing


def test_pressure_writes_what_ram_evicts_while_the_disk_has_room_then_asks_the_filter() -> None:
    # a first turn (no return rate measured yet: the filter refuses it) leaves RAM, comes back
    trace = [request(turn(1, 1)), filler(1), filler(2), request(turn(1, 2))]
    hits = {}
    for rule, l2 in (("filter", 1000), ("pressure", 1000), ("pressure", 30)):
        s = replay(trace, capacity=100, l2_capacity=l2, eval_start=3, l2_write=rule).summary()
        hits[rule, l2] = s["eval_l2_hit_tokens"]
    assert hits["filter", 1000] == 0  # refused, though the disk was empty
    assert hits["pressure", 1000] == len(turn(1, 1))  # room: written, and it came back
    assert hits["pressure", 30] == 0  # no room for it: the filter decides, and refuses


def test_l2_evicts_to_its_capacity_leaf_first() -> None:
    trace = [request(turn(1, 1)), request(turn(1, 2)), filler(1), filler(2), request(turn(1, 3))]
    small = replay(trace, capacity=100, l2_capacity=40, eval_start=4)
    assert small.l2 is not None and small.l2.tree.num_tokens <= 40
    small.l2.tree.check_integrity()
    s = small.summary()
    # the path's tail went first: what is left of it is a prefix of turn 3
    assert s["eval_l2_hit_tokens"] == small.l2.tree.peek(np.array(turn(1, 3))) - 0
    assert s["l2_evicted_tokens"] > 0


traces = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=6).map(lambda p: request(p, [])),
    min_size=1,
    max_size=7,
)


@settings(max_examples=25, deadline=None)
@given(trace=traces, capacity=st.integers(6, 14))
def test_belady_is_at_least_lru_and_matches_the_brute_force_optimum(
    trace: list[TraceRequest], capacity: int
) -> None:
    oracle = belady(trace, capacity, block=1)
    lru = replay(trace, capacity=capacity).summary()
    assert oracle.prompt_tokens == lru["prompt_tokens"]
    assert oracle.hit_tokens >= lru["hit_tokens"]
    assert oracle.hit_tokens == optimum(trace, capacity)


def optimum(trace: list[TraceRequest], capacity: int) -> int:
    """Brute force over every choice of what to keep after each request (token prefixes as
    units, prefix-closed, the current request kept whole)."""
    best: dict[frozenset[tuple[int, ...]], int] = {frozenset(): 0}
    for r in trace:
        seq = tuple(r.full.tolist())
        mine = [seq[:i] for i in range(1, len(seq) + 1)]
        nxt: dict[frozenset[tuple[int, ...]], int] = {}
        for cached, hits in best.items():
            hit = next((i for i in range(len(seq)) if seq[: i + 1] not in cached), len(seq))
            full = cached | set(mine)
            others = sorted(full - set(mine))
            for k in range(len(others) + 1):
                for drop in itertools.combinations(others, k):
                    keep = full - set(drop)
                    if len(keep) > capacity or any(u[:-1] and u[:-1] not in keep for u in keep):
                        continue
                    state = frozenset(keep)
                    nxt[state] = max(nxt.get(state, -1), hits + min(hit, r.prompt_len))
        best = nxt
    return max(best.values())


def test_cli_reports_tiers_and_the_gap(tmp_path: Path) -> None:
    lines = [{"prompt": p} for p in ([1, 2, 3], [1, 2, 4], [9, 9], [1, 2, 3, 5])]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o.json"
    args = ["bench", "cache", "--trace", str(trace), "--capacity", "6", "--eviction", "gdsf"]
    tiers = ["--l2-capacity", "50", "--belady", "--belady-block", "1"]
    assert main([*args, *tiers, "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["eviction"] == "gdsf" and s["l2_capacity_tokens"] == 50
    assert s["belady_l1_hit_rate"] >= s["lru_l1_hit_rate"] and "gap_closed" in s
    assert set(s["host"]) >= {"cpu", "cores"}
    assert main([*args, "--eval-from", "1.5"]) == 2


def test_first_turns_are_written_only_once_enough_of_them_come_back() -> None:
    rng = np.random.default_rng(0)
    one_shot = [request(rng.integers(1 << 20, 1 << 40, 80).tolist()) for _ in range(200)]
    s = replay(one_shot, capacity=400, l2_capacity=10_000, l2_write="filter").summary()
    assert s["l2_bytes_written"] == 0 and s["l2_rejected_tokens"] > 0  # no return: no writes
    # half of 100 conversations come back 15 conversations later, long after L1 dropped them:
    # once 64 first turns were seen (the rate is trusted) first turns are written, and the
    # second turns of the later conversations hit L2
    chats = []
    for c in range(100):
        chats.append(request(turn(c, 1)))
        if c >= 15 and c % 2:
            chats.append(request(turn(c - 15, 2)))
    tiered = replay(chats, capacity=400, l2_capacity=100_000, l2_write="filter")
    assert tiered.l2 is not None
    rate = tiered.l2.turns.return_rate(1)
    assert rate is not None and rate >= 0.25
    assert tiered.summary()["eval_l2_hit_tokens"] > 0
