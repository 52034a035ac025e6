"""The Scheduler is the one writer of a request's KV state: `node`, `slots`,
`cached_len`, `computed_len` (and `forks`, the samples that will start on its prompt) change
only inside radixlm/engine/scheduler.py, through every
path a request can take (chunked prefill, n > 1 forks, pages, retraction, abort, a failed
request, a failed forward pass), and each path ends with the slot account at idle."""

from __future__ import annotations

import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import assert_idle, outputs, run

from radixlm.api_types import SamplingParams
from radixlm.engine.engine import Engine, ForwardError
from radixlm.engine.request import Request

# forks: the samples that wait on it; draft_slots: a verify step's draft rows
KV_FIELDS = {"node", "slots", "cached_len", "computed_len", "draft_slots", "forks"}


@pytest.fixture
def kv_writers(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """'file:function' of every write to a request's KV fields after its construction."""
    writers: Counter[str] = Counter()
    original = Request.__setattr__

    def record(self: Request, name: str, value: Any) -> None:
        if name in KV_FIELDS:
            code = sys._getframe(1).f_code
            if code.co_name != "__init__":
                writers[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        original(self, name, value)

    monkeypatch.setattr(Request, "__setattr__", record)
    return writers


def random_prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(25)]
    return [
        system + [rng.randrange(1, 250) for _ in range(rng.randrange(3, 30))] for _ in range(count)
    ]


@pytest.mark.parametrize("page_size", [1, 4])
def test_only_the_scheduler_writes_request_kv_state(
    make_engine: Callable[..., Engine], kv_writers: Counter[str], page_size: int
) -> None:
    prompts = random_prompts(page_size, 10)
    params = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=30, ignore_eos=True)
    reference = outputs(run(make_engine(cache="none"), prompts, params))
    # tight memory: retractions; small chunks: chunked prefill; n = 2: forks
    tight = make_engine(num_slots=200, page_size=page_size, chunk_size=8, max_running_requests=8)
    assert outputs(run(tight, prompts, params)) == reference
    assert tight.scheduler.num_retractions > 0
    abort_mid_decode(tight, prompts[0])
    fail_a_request(tight, prompts[1])
    fail_a_forward_pass(tight, prompts[2:5])
    assert {w.split(":")[0] for w in kv_writers} == {"scheduler.py"}, kv_writers
    functions = {w.split(":")[1] for w in kv_writers}
    assert {"_start", "postprocess", "_commit", "_drop_kv"} <= functions


def abort_mid_decode(engine: Engine, prompt: list[int]) -> None:
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, n=2))
    while not engine.requests(rid)[0].output_ids:
        engine.step()
    engine.abort(rid)
    assert_idle(engine)


def fail_a_request(engine: Engine, prompt: list[int]) -> None:
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    req = engine.requests(rid)[0]

    def broken(token_id: int) -> Any:
        raise RuntimeError("injected detokenizer fault")

    req.output_stream.push = broken  # type: ignore[method-assign]  # a fault injected for this test
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason == "error"
    assert_idle(engine)


def fail_a_forward_pass(engine: Engine, prompts: list[list[int]]) -> None:
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    forward = engine.runner.forward

    def broken(batch: Any) -> Any:
        raise RuntimeError("injected forward fault")

    engine.runner.forward = broken  # type: ignore[method-assign]  # a fault injected for this test
    with pytest.raises(ForwardError) as failure:
        engine.step()
    engine.runner.forward = forward  # type: ignore[method-assign]  # the engine's own again
    engine.fail(failure.value.request_ids, "internal error")
    while engine.has_unfinished():
        engine.step()
    assert_idle(engine)
