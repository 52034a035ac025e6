"""Benchmark workloads as token ids, and the prefill an ideal cache would compute for them.

A workload is a list of requests in dispatch order. A request may continue an earlier one (its
parent): its prompt is the parent's prompt + the parent's *actual* output + its own new tokens,
so it exists only once the parent has finished. `WorkloadProgress` holds that bookkeeping for a
runner (the offline engine bench and the async HTTP bench alike): which requests may go now, and
what their prompts are. `ideal_prefill_tokens` is the bar a cache is measured against.

Tokens are drawn with a seed from a caller-given id range (so special tokens are avoided).
Siblings (requests that share everything before their own new tokens) start with distinct
tokens, so the intended sharing is exactly the sharing there is.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class WorkloadRequest(NamedTuple):
    parent: int | None  # index of the request this one continues, or None for a fresh prompt
    new_tokens: tuple[int, ...]  # appended after the parent's prompt and output
    output_len: int  # tokens to generate (benchmarks run with ignore_eos)


@dataclass(frozen=True)
class Workload:
    """Requests in dispatch order; every parent comes before its children."""

    name: str
    requests: tuple[WorkloadRequest, ...]

    def __post_init__(self) -> None:
        for i, request in enumerate(self.requests):
            if request.parent is not None and not 0 <= request.parent < i:
                raise ValueError(f"request {i}: parent {request.parent} must be an earlier one")
            if request.output_len < 1:
                raise ValueError(f"request {i}: output_len must be >= 1")


class CompletedRequest(NamedTuple):
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def resolve_prompt(request: WorkloadRequest, parent: CompletedRequest | None) -> list[int]:
    """The prompt of `request`: its parent's prompt + output (none for a root) + its new tokens."""
    if (parent is None) != (request.parent is None):
        raise ValueError("a request with a parent needs its completed parent, and only then")
    history = [] if parent is None else [*parent.prompt_ids, *parent.output_ids]
    return [*history, *request.new_tokens]


class WorkloadProgress:
    """One run of a workload: which requests may be dispatched and what their prompts are.

    progress = WorkloadProgress(workload)
    dispatch(progress.roots)                       # each with progress.prompt(i)
    on finish of i: dispatch(progress.finish(i, output_ids))
    when progress.done: ideal_prefill_tokens(progress.completed())
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.roots = [i for i, r in enumerate(workload.requests) if r.parent is None]
        self._children: dict[int, list[int]] = {}
        for i, request in enumerate(workload.requests):
            if request.parent is not None:
                self._children.setdefault(request.parent, []).append(i)
        self._completed: dict[int, CompletedRequest] = {}

    @property
    def done(self) -> bool:
        return len(self._completed) == len(self.workload.requests)

    def prompt(self, index: int) -> list[int]:
        """Prompt ids of request `index`; raises ValueError while its parent is unfinished."""
        request = self.workload.requests[index]
        if request.parent is not None and request.parent not in self._completed:
            raise ValueError(f"request {index} waits for request {request.parent} to finish")
        parent = None if request.parent is None else self._completed[request.parent]
        return resolve_prompt(request, parent)

    def finish(self, index: int, output_ids: Sequence[int]) -> list[int]:
        """Record request `index`'s output; return its children, which may be dispatched now."""
        if index in self._completed:
            raise ValueError(f"request {index} already finished")
        self._completed[index] = CompletedRequest(self.prompt(index), list(output_ids))
        return list(self._children.get(index, []))

    def completed(self) -> list[CompletedRequest]:
        """The finished requests, in workload order."""
        return [self._completed[i] for i in sorted(self._completed)]


def ideal_prefill_tokens(completed: Iterable[CompletedRequest]) -> int:
    """Prompt tokens an ideal cache computes: every prompt token that nobody computed before.

    A request computes KV for prompt + output[:-1] (the last output token is sampled, never fed
    back). Put all those sequences in one prefix trie, each node a token in its full context.
    Nodes on an output part were computed by decode; the ideal prefill is the number of nodes
    on some prompt part and on no output part. When no two requests decode the same context,
    this equals distinct trie nodes - sum(len(output) - 1).

    An engine recomputes a prompt's last token when the whole prompt is cached (it needs its
    logits); the ideal does not count that, so such hits show up as prefill above the ideal.
    Assumes any output another prompt contains was generated before that prompt ran (true for
    parent-linked workloads). Cost: O(total tokens) time and memory.
    """
    child_of: dict[int, int] = {}  # (node << 32 | token) -> child node; node 0 is the root
    prompt_nodes: set[int] = set()
    decode_nodes: set[int] = set()
    for request in completed:
        node = 0
        for depth, token in enumerate([*request.prompt_ids, *request.output_ids[:-1]]):
            node = child_of.setdefault(node << 32 | token, len(child_of) + 1)
            (prompt_nodes if depth < len(request.prompt_ids) else decode_nodes).add(node)
    return len(prompt_nodes - decode_nodes)


def gsp(
    *,
    token_range: range,
    seed: int = 0,
    num_groups: int = 4,
    prompts_per_group: int = 8,
    system_prompt_len: int = 1024,
    question_len: int = 64,
    output_len: int = 16,
) -> Workload:
    """Generated shared prefix (SGLang bench_serving's parameters): each group shares a system
    prompt, each prompt adds its own question. Requests arrive with the groups interleaved."""
    draw = _Draw(token_range, seed)
    requests = []
    for system in draw.siblings(num_groups, system_prompt_len):
        for question in draw.siblings(prompts_per_group, question_len):
            requests.append(WorkloadRequest(None, system + question, output_len))
    order = draw.rng.permutation(len(requests))
    return Workload("gsp", tuple(requests[i] for i in order))


def multiturn(
    *,
    token_range: range,
    seed: int = 0,
    num_conversations: int = 8,
    num_turns: int = 4,
    turn_len: int = 64,
    output_len: int = 32,
) -> Workload:
    """Conversations whose every turn sends the whole history (with the previous answer as the
    model gave it) plus a new user message of turn_len tokens."""
    draw = _Draw(token_range, seed)
    firsts = draw.siblings(num_conversations, turn_len)
    return _chains("multiturn", draw, num_turns, firsts, turn_len, output_len)


def followup(
    *,
    token_range: range,
    seed: int = 0,
    num_conversations: int = 8,
    history_len: int = 1000,
    num_turns: int = 4,
    turn_len: int = 16,
    output_len: int = 8,
) -> Workload:
    """The follow-up benchmark: conversations that start with a long history (history_len
    tokens), then `num_turns` short turns of turn_len new tokens each, every one over its whole
    history cached: a small extend over a long prefix, the next turn of a chat."""
    draw = _Draw(token_range, seed)
    firsts = draw.siblings(num_conversations, history_len)
    return _chains("followup", draw, num_turns + 1, firsts, turn_len, output_len)


def tot(
    *,
    token_range: range,
    seed: int = 0,
    branching: int = 3,
    depth: int = 2,
    root_len: int = 256,
    step_len: int = 32,
    output_len: int = 32,
) -> Workload:
    """Tree of thought: a root prompt, and `branching` children under every node down to `depth`
    levels below the root; each child is its parent's prompt + output + step_len new tokens.
    Requests are listed level by level."""
    draw = _Draw(token_range, seed)
    requests = [WorkloadRequest(None, draw.tokens(root_len), output_len)]
    level = [0]
    for _ in range(depth):
        next_level = []
        for parent in level:
            for step in draw.siblings(branching, step_len):
                next_level.append(len(requests))
                requests.append(WorkloadRequest(parent, step, output_len))
        level = next_level
    return Workload("tot", tuple(requests))


def fewshot(
    *,
    token_range: range,
    seed: int = 0,
    num_requests: int = 16,
    shared_len: int = 1024,
    question_len: int = 32,
    output_len: int = 16,
) -> Workload:
    """One long few-shot block shared by every request, then a unique question."""
    draw = _Draw(token_range, seed)
    shared = draw.tokens(shared_len)
    questions = draw.siblings(num_requests, question_len)
    return Workload(
        "fewshot", tuple(WorkloadRequest(None, shared + q, output_len) for q in questions)
    )


def agent(
    *,
    token_range: range,
    seed: int = 0,
    num_agents: int = 4,
    num_steps: int = 4,
    system_prompt_len: int = 512,
    task_len: int = 64,
    observation_len: int = 128,
    output_len: int = 32,
) -> Workload:
    """Agent loops: a system prompt (tool schemas) shared by all agents, a task per agent, then
    steps that each append the previous action (the output) and a tool observation."""
    draw = _Draw(token_range, seed)
    system, tasks = draw.tokens(system_prompt_len), draw.siblings(num_agents, task_len)
    firsts = [system + task for task in tasks]
    return _chains("agent", draw, num_steps, firsts, observation_len, output_len)


def random(
    *,
    token_range: range,
    seed: int = 0,
    num_requests: int = 32,
    prompt_len: int = 512,
    output_len: int = 16,
) -> Workload:
    """Independent prompts that share nothing, not even a first token: the control."""
    draw = _Draw(token_range, seed)
    prompts = draw.siblings(num_requests, prompt_len)
    return Workload("random", tuple(WorkloadRequest(None, p, output_len) for p in prompts))


WORKLOADS: Mapping[str, Callable[..., Workload]] = {
    "gsp": gsp,
    "multiturn": multiturn,
    "followup": followup,
    "tot": tot,
    "fewshot": fewshot,
    "agent": agent,
    "random": random,
}


def _chains(
    name: str,
    draw: _Draw,
    length: int,
    firsts: Sequence[tuple[int, ...]],
    step_len: int,
    output_len: int,
) -> Workload:
    """One chain of `length` requests per prompt in `firsts`, listed step by step; each later
    request continues the previous one of its chain with step_len new tokens."""
    requests = [WorkloadRequest(None, first, output_len) for first in firsts]
    for _ in range(length - 1):
        for _ in firsts:
            parent = len(requests) - len(firsts)  # the same chain, one step back
            requests.append(WorkloadRequest(parent, draw.tokens(step_len), output_len))
    return Workload(name, tuple(requests))


class _Draw:
    """Seeded token ids from `token_range`."""

    def __init__(self, token_range: range, seed: int) -> None:
        if token_range.step != 1 or len(token_range) < 2:
            raise ValueError("token_range must be a contiguous range of at least 2 ids")
        self.token_range = token_range
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> tuple[int, ...]:
        ids = self.rng.integers(self.token_range.start, self.token_range.stop, size=n)
        return tuple(ids.tolist())

    def siblings(self, count: int, n: int) -> list[tuple[int, ...]]:
        """`count` sequences of n tokens whose first tokens differ (when n > 0)."""
        if n == 0:
            return [()] * count
        if count > len(self.token_range):
            raise ValueError(f"{count} siblings need as many distinct ids; token_range is smaller")
        firsts = self.rng.choice(len(self.token_range), size=count, replace=False)
        return [(self.token_range.start + int(f), *self.tokens(n - 1)) for f in firsts]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """`--workload NAME`, `--seed`, and one flag per generator parameter, named
    `--<workload>-<param>` (e.g. `--gsp-num-groups`, as in SGLang's bench_serving)."""
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gsp")
    parser.add_argument("--seed", type=int, default=0)
    for name, generator in WORKLOADS.items():
        group = parser.add_argument_group(f"{name} workload")
        for param in _parameters(generator):
            flag = f"--{name}-{param.name.replace('_', '-')}"
            group.add_argument(flag, type=int, default=param.default, metavar="N")


def workload_from_args(args: argparse.Namespace, token_range: range) -> Workload:
    """The workload the flags of `add_workload_arguments` describe."""
    generator = WORKLOADS[args.workload]
    return generator(token_range=token_range, seed=args.seed, **workload_params(args))


def workload_params(args: argparse.Namespace) -> dict[str, int]:
    """The chosen workload's parameters, for a benchmark's JSON."""
    generator = WORKLOADS[args.workload]
    return {p.name: getattr(args, f"{args.workload}_{p.name}") for p in _parameters(generator)}


def _parameters(generator: Callable[..., Workload]) -> list[inspect.Parameter]:
    skip = {"token_range", "seed"}
    return [p for p in inspect.signature(generator).parameters.values() if p.name not in skip]
