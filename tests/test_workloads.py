"""Benchmark workloads: the sharing each one promises, determinism, parent resolution, and the
ideal prefill count against hand-computed values and a brute-force ideal cache."""

from __future__ import annotations

import itertools
import json
from collections import deque
from pathlib import Path

import pytest
from helpers import save_tiny_model

from radixlm.bench.workloads import (
    WORKLOADS,
    CompletedRequest,
    Workload,
    WorkloadProgress,
    WorkloadRequest,
    agent,
    fewshot,
    followup,
    gsp,
    ideal_prefill_tokens,
    multiturn,
    random,
    resolve_prompt,
    tot,
)
from radixlm.cli import main

IDS = range(1000, 2000)


def run(workload: Workload) -> WorkloadProgress:
    """Run like an engine would: a request starts once its parent finished. Every output token
    is new (ids from 100000 up), so outputs share nothing by chance."""
    progress = WorkloadProgress(workload)
    fresh = itertools.count(100_000)
    queue = deque(progress.roots)
    while queue:
        i = queue.popleft()
        queue.extend(
            progress.finish(i, [next(fresh) for _ in range(workload.requests[i].output_len)])
        )
    assert progress.done
    return progress


def brute_force_ideal(completed: list[CompletedRequest]) -> int:
    """An ideal cache that remembers every computed prefix, fed the requests in order."""
    computed: set[tuple[int, ...]] = set()
    prefill = 0
    for prompt, output in completed:
        sequence = (*prompt, *output[:-1])
        prefill += sum(tuple(prompt[: n + 1]) not in computed for n in range(len(prompt)))
        computed.update(sequence[: n + 1] for n in range(len(sequence)))
    return prefill


SMALL_WORKLOADS = {
    # every group: its system prompt once, then each question
    "gsp": (
        gsp(token_range=IDS, num_groups=3, prompts_per_group=4, system_prompt_len=10,
            question_len=5, output_len=3),
        3 * (10 + 4 * 5),
    ),
    "fewshot": (
        fewshot(token_range=IDS, num_requests=5, shared_len=20, question_len=4, output_len=2),
        20 + 5 * 4,
    ),
    "random": (random(token_range=IDS, num_requests=6, prompt_len=7, output_len=2), 6 * 7),
    # a later turn prefills the previous answer's last token (never fed back) + its message
    "multiturn": (
        multiturn(token_range=IDS, num_conversations=2, num_turns=3, turn_len=5, output_len=4),
        2 * (5 + 2 * (1 + 5)),
    ),
    "multiturn-output-1": (
        multiturn(token_range=IDS, num_conversations=3, num_turns=2, turn_len=4, output_len=1),
        3 * (4 + 1 + 4),
    ),
    # a follow-up prefills the previous answer's last token + its few new tokens
    "followup": (
        followup(token_range=IDS, num_conversations=2, history_len=10, num_turns=2, turn_len=3,
                 output_len=2),
        2 * (10 + 2 * (1 + 3)),
    ),
    # 7 nodes, 3 of them parents: a parent's last output token is prefilled once for its children
    "tot": (
        tot(token_range=IDS, branching=2, depth=2, root_len=8, step_len=3, output_len=4),
        8 + 3 * 1 + 6 * 3,
    ),
    "agent": (
        agent(token_range=IDS, num_agents=2, num_steps=3, system_prompt_len=10, task_len=4,
              observation_len=6, output_len=2),
        10 + 2 * (4 + 2 * (1 + 6)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", SMALL_WORKLOADS)
def test_ideal_prefill_of_small_workloads(name: str) -> None:
    workload, ideal = SMALL_WORKLOADS[name]
    completed = run(workload).completed()
    assert ideal_prefill_tokens(completed) == ideal
    assert brute_force_ideal(completed) == ideal


def test_ideal_prefill_on_hand_made_tries() -> None:
    siblings = [CompletedRequest([1, 2, 3], [9]), CompletedRequest([1, 2, 4], [9])]
    assert ideal_prefill_tokens(siblings) == 4  # 1, 2 shared; 3 and 4
    parent, child = CompletedRequest([1, 2], [5, 6]), CompletedRequest([1, 2, 5, 6, 7], [8])
    assert ideal_prefill_tokens([parent, child]) == 4  # 5 came from decode; 6 never fed back
    # Two identical requests decode the same tokens: distinct nodes - decoded tokens would be
    # 3 - 2 = 1, but the prompt [1, 2] still had to be computed once.
    twins = [CompletedRequest([1, 2], [3, 4]), CompletedRequest([1, 2], [3, 4])]
    assert ideal_prefill_tokens(twins) == 2
    # A prompt that is wholly cached costs the ideal nothing (an engine recomputes one token).
    assert (
        ideal_prefill_tokens([CompletedRequest([1, 2, 3], [9]), CompletedRequest([1, 2], [7])]) == 3
    )


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_each_workload_is_deterministic_and_stays_in_its_id_range(name: str) -> None:
    build = WORKLOADS[name]
    first, again, other = (
        build(token_range=IDS, seed=1),
        build(token_range=IDS, seed=1),
        build(token_range=IDS, seed=2),
    )
    assert first == again
    assert first != other
    assert first.name == name
    tokens = {t for r in first.requests for t in r.new_tokens}
    assert tokens and min(tokens) >= IDS.start and max(tokens) < IDS.stop
    completed = run(first).completed()
    assert ideal_prefill_tokens(completed) == brute_force_ideal(completed)


def test_random_shares_no_prefix() -> None:
    workload = random(token_range=IDS, num_requests=64, prompt_len=16)
    firsts = [r.new_tokens[0] for r in workload.requests]
    assert len(set(firsts)) == len(firsts)
    completed = run(workload).completed()
    assert ideal_prefill_tokens(completed) == sum(len(c.prompt_ids) for c in completed)


def test_gsp_interleaves_groups() -> None:
    workload = gsp(
        token_range=IDS, num_groups=4, prompts_per_group=8, system_prompt_len=4, question_len=2
    )
    groups = [r.new_tokens[:4] for r in workload.requests]
    assert len(set(groups)) == 4
    assert groups[:8] != [groups[0]] * 8  # not group after group


def test_children_wait_for_their_parent_and_see_its_actual_output() -> None:
    workload = multiturn(
        token_range=IDS, num_conversations=2, num_turns=2, turn_len=3, output_len=2
    )
    progress = WorkloadProgress(workload)
    assert progress.roots == [0, 1]
    child = workload.requests[2]
    assert child.parent == 0
    with pytest.raises(ValueError, match="waits for request 0"):
        progress.prompt(2)
    first_prompt = progress.prompt(0)
    assert progress.finish(0, [7, 8]) == [2]
    assert progress.prompt(2) == [*first_prompt, 7, 8, *child.new_tokens]
    with pytest.raises(ValueError, match="already finished"):
        progress.finish(0, [7, 8])
    assert not progress.done


def test_resolve_prompt_needs_exactly_the_parent_it_names() -> None:
    root, child = WorkloadRequest(None, (1, 2), 1), WorkloadRequest(0, (5,), 1)
    assert resolve_prompt(root, None) == [1, 2]
    assert resolve_prompt(child, CompletedRequest([1, 2], [3, 4])) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        resolve_prompt(child, None)
    with pytest.raises(ValueError):
        resolve_prompt(root, CompletedRequest([1], [2]))


def test_workload_rejects_forward_parents_and_empty_outputs() -> None:
    with pytest.raises(ValueError, match="earlier"):
        Workload("bad", (WorkloadRequest(1, (1,), 1), WorkloadRequest(None, (2,), 1)))
    with pytest.raises(ValueError, match="output_len"):
        Workload("bad", (WorkloadRequest(None, (1,), 0),))
    with pytest.raises(ValueError, match="token_range"):
        random(token_range=range(5, 6))


def test_bench_offline_end_to_end(tmp_path: Path) -> None:
    """`radixlm bench offline` on a tiny model: both modes finish every request, the radix cache
    computes exactly the ideal prefill, and step time splits into prefill and decode steps."""
    save_tiny_model("llama-gqa-llama3rope", tmp_path / "model", vocab_size=32_000)
    out = tmp_path / "offline.json"
    args = ["bench", "offline", "--model", str(tmp_path / "model"), "--threads", "1"]
    args += ["--workload", "gsp", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3"]
    args += ["--gsp-system-prompt-len", "48", "--gsp-question-len", "8", "--gsp-output-len", "4"]
    assert main([*args, "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    radix, none = modes["radix"], modes["none"]
    assert radix["requests"] == none["requests"] == 6
    assert radix["prefill_tokens"] == radix["ideal_prefill_tokens"] == 2 * 48 + 6 * 8
    assert none["prefill_tokens"] == 6 * (48 + 8)
    for mode in (radix, none):
        steps = mode["prefill_steps_s"] + mode["decode_steps_s"]
        assert 0 < steps <= mode["duration_s"]
        assert mode["prefill_steps_s"] > 0 and mode["decode_steps_s"] > 0
    # two in flight at a time, in workload order (as a served run sees them): all finish, and
    # the tree still computes only the ideal prefill
    assert main([*args, "--cache", "radix", "--in-flight", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["in_flight"] == 2
    assert result["modes"]["radix"]["requests"] == 6
    assert result["modes"]["radix"]["prefill_tokens"] == 2 * 48 + 6 * 8
