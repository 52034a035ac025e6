"""Request traces of other shapes for `bench cache`: the project's workload generators in time.

A workload generator (bench/workloads.py) lists requests and the earlier request each one
continues; a trace needs them in arrival order, with their outputs. Here each generator runs
`copies` times with different seeds (independent families: conversations, agents, documents,
trees of thought), every output is fresh token ids (a model's answer, shared with nothing
before it), and requests are given arrival times: a family's roots arrive uniformly over the
trace's span, and a request that continues another arrives a think time after it (exponential,
a mean of `gap` of the span). So families interleave and come back after other traffic has run,
as in a served trace, and a cache of a given size keeps only some of them.

    trace = shape_trace("agent", seed=0)          # list[TraceRequest], in arrival order

Shapes (each sized for cache pressure at 1M tokens of RAM; `SHAPES` holds the parameters):
- `chat`: multi-turn conversations, every turn the whole history plus a new message;
- `agent`: agent loops under one shared system prompt (tool schemas), each step appending the
  previous action and a tool observation;
- `fewshot`: long few-shot blocks, each shared by many one-shot questions;
- `documents`: long shared documents (gsp), each asked about by a group of prompts;
- `tot`: trees of thought, each node extending its parent;
- `sessions`: sessions under shared system prompts, most of them one-shot (agent loops of one
  step) and a few of five turns: few first turns come back, so a write filter refuses them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from radixlm.bench.traces import TraceRequest
from radixlm.bench.workloads import WORKLOADS, Workload

TOKENS = range(1, 1 << 40)  # wide enough that independently drawn runs never collide


class Shape(NamedTuple):
    workload: str  # a name in bench/workloads.py's WORKLOADS
    copies: int  # independent families (one generator run each)
    spread: float  # a family's roots arrive over this share of the span after its start
    gap: float  # mean think time before a continuation, as a share of the span
    params: dict[str, int]  # the generator's (lengths are multiples of 64 tokens)
    more: tuple[tuple[int, dict[str, int]], ...] = ()  # (copies, params) of other families


SHAPES: dict[str, Shape] = {
    "chat": Shape("multiturn", 240, 0.01, 0.04, dict(num_conversations=10, num_turns=6,
                                                      turn_len=256, output_len=192)),
    "agent": Shape("agent", 128, 0.01, 0.01, dict(num_agents=8, num_steps=8,
                                                   system_prompt_len=2048, task_len=256,
                                                   observation_len=384, output_len=128)),
    "fewshot": Shape("fewshot", 192, 0.05, 0.0, dict(num_requests=24, shared_len=4096,
                                                      question_len=128, output_len=64)),
    "documents": Shape("gsp", 256, 0.05, 0.0, dict(num_groups=2, prompts_per_group=12,
                                                    system_prompt_len=4096, question_len=128,
                                                    output_len=64)),
    "tot": Shape("tot", 96, 0.01, 0.02, dict(branching=3, depth=4, root_len=2048, step_len=256,
                                              output_len=128)),
    # sessions under shared system prompts, most of them one-shot: few first turns come back
    "sessions": Shape("agent", 320, 0.01, 0.03, dict(num_agents=8, num_steps=1,
                                                      system_prompt_len=512, task_len=768,
                                                      observation_len=256, output_len=192),
                      more=((64, dict(num_agents=8, num_steps=5, system_prompt_len=512,
                                      task_len=768, observation_len=256, output_len=192)),)),
}  # fmt: skip


def shape_trace(name: str, seed: int = 0) -> list[TraceRequest]:
    """The trace of shape `name` (see SHAPES), deterministic for a seed."""
    shape = SHAPES[name]
    rng = np.random.default_rng(seed)
    fresh = [1 << 41]  # the next output id, above every drawn token
    timed: list[tuple[float, int, TraceRequest]] = []
    copy = 0
    for copies, params in ((shape.copies, shape.params), *shape.more):
        for _ in range(copies):
            workload = WORKLOADS[shape.workload](
                token_range=TOKENS, seed=seed * 100_003 + copy, **params
            )
            timed += _timed(workload, rng, shape, fresh)
            copy += 1
    timed.sort(key=lambda t: (t[0], t[1]))
    return [request for _, _, request in timed]


def describe(name: str) -> dict[str, Any]:
    """The shape's parameters, for a benchmark's JSON."""
    shape = SHAPES[name]
    out = {"workload": shape.workload, "copies": shape.copies, "spread": shape.spread,
           "gap": shape.gap, **shape.params}  # fmt: skip
    return out | ({"more": [dict(copies=c, **p) for c, p in shape.more]} if shape.more else {})


def _timed(
    workload: Workload, rng: np.random.Generator, shape: Shape, fresh: list[int]
) -> list[tuple[float, int, TraceRequest]]:
    """Each request of one family with its arrival time (a share of the span) and its index."""
    start = float(rng.random())
    arrival: list[float] = []
    full: list[np.ndarray] = []
    out: list[tuple[float, int, TraceRequest]] = []
    for i, request in enumerate(workload.requests):
        if request.parent is None:
            at, history = start + float(rng.random()) * shape.spread, np.empty(0, np.int64)
        else:
            at = arrival[request.parent] + float(rng.exponential(shape.gap))
            history = full[request.parent]
        prompt = np.concatenate([history, np.array(request.new_tokens, dtype=np.int64)])
        output = np.arange(fresh[0], fresh[0] + request.output_len, dtype=np.int64)
        fresh[0] += request.output_len
        ids = np.concatenate([prompt, output])
        arrival.append(at)
        full.append(ids)
        out.append((at, i, TraceRequest(ids, len(prompt))))
    return out
