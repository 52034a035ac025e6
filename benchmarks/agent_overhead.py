"""The grammar's cost: a decode step of 8 constrained requests against 8 unconstrained ones.

    python benchmarks/agent_overhead.py [--dtype float32] [--steps 24]

Both batches run the default model in this process, greedy, on the same 8 prompts. Each request's
output is under a JSON Schema (an object with a list of notes: long enough that no request ends
inside the window) or free; a step is timed only while all 8 requests are decoding. The figure is
the median step time, constrained over unconstrained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["notes"],
}


def _decode_steps(engine: Any, params: Any, prompts: list[list[int]], steps: int) -> list[float]:
    """Step times (s) while every request of the batch is decoding."""
    ids = [engine.add_request(p, params) for p in prompts]
    times: list[float] = []
    while engine.has_unfinished() and len(times) < steps:
        decoding = _all_decoding(engine, ids)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    return times


def _all_decoding(engine: Any, ids: list[str]) -> bool:
    try:
        samples = [r for rid in ids for r in engine.requests(rid)]
    except KeyError:  # one has finished
        return False
    return all(r.computed_len >= r.prompt_len and not r.finished for r in samples)


def grammar_overhead(dtype: str = "float32", steps: int = 24, batch: int = 8) -> dict[str, Any]:
    from radixlm.agents.grammar import GrammarCompiler
    from radixlm.agents.prompt import PromptRenderer
    from radixlm.api_types import SamplingParams
    from radixlm.config import ModelConfig
    from radixlm.engine.engine import Engine

    engine = Engine(ModelConfig(dtype=dtype))  # type: ignore[arg-type]
    tokenizer = engine.tokenizer
    compiler = GrammarCompiler(tokenizer, engine.runner.vocab_size)
    constraint = compiler.json_schema(SCHEMA, strict=True)
    renderer = PromptRenderer(tokenizer)
    prompts = [
        renderer.prompt_ids(
            [{"role": "user", "content": f"Note {i}: list what a data centre checks each day."}]
        )
        for i in range(batch)
    ]
    free = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=steps + 8, temperature=0.0, constraint=constraint)
    _decode_steps(engine, free, prompts, 4)  # warm-up: kernels, caches, the prompts' KV
    _decode_steps(engine, constrained, prompts, 4)
    result: dict[str, Any] = {"batch": batch, "dtype": dtype}
    for name, params in (("unconstrained", free), ("constrained", constrained)):
        times = _decode_steps(engine, params, prompts, steps)
        result[name] = {"steps": len(times), "median_ms": round(statistics.median(times) * 1e3, 3),
                        "mean_ms": round(statistics.mean(times) * 1e3, 3)}  # fmt: skip
    ratio = result["constrained"]["median_ms"] / result["unconstrained"]["median_ms"]
    result["slowdown"] = round(ratio - 1.0, 4)
    result["target"] = 0.10
    result["met"] = ratio - 1.0 <= 0.10
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    print(json.dumps(grammar_overhead(args.dtype, args.steps), indent=1))


if __name__ == "__main__":
    main()
