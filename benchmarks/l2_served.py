"""What the L2 disk tier buys a served engine, and what it costs when it cannot help.

    python benchmarks/l2_served.py [--rounds 5] [--json docs/bench/l2_served.json]

Two engines on the default model run side by side in this process with the same small KV pool:
one with an L2 page file (`--l2-dir` in a temporary directory), one without. Two workloads:

- multiturn: C conversations with a long first prompt, taken in turns round-robin (every
  conversation's turn t, then every one's turn t + 1), one request at a time, so each
  conversation's KV has left RAM by the time it comes back. The figure is the TTFT of turns
  3 and later: loaded from disk with L2, recomputed without. Turn 2 is recomputed in both arms
  (by design: L2 writes a first turn only once it had a hit or first turns measurably come
  back, which a few conversations cannot show) and is reported apart.
- random: prompts sharing nothing, all submitted at once, through a pool they overflow. The
  figure is output tok/s: the tier must cost nothing when it cannot help (first turns are not
  worth a write, so nothing is written).

Each round runs both arms on fresh prompts, in alternating order, after flushing both tiers;
per workload the figure is the median over rounds of the per-round ratio (paired). Greedy, EOS
ignored; the outputs of the two arms are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm.engine.engine import Engine

TOKEN_RANGE = (1000, 30000)  # past the special tokens, inside the vocabulary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-slots", type=int, default=4096, help="KV pool, tokens")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3, help="at least 3")
    parser.add_argument("--first-len", type=int, default=2048, help="first prompt, tokens")
    parser.add_argument("--turn-len", type=int, default=32, help="new tokens per later turn")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--random-requests", type=int, default=24)
    parser.add_argument("--random-len", type=int, default=384)
    parser.add_argument("--random-output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.turns < 3:
        raise SystemExit("--turns must be at least 3: a first turn is not written to disk")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="radixlm-l2-") as l2_dir:
        arms = {"l2": make_engine(args, l2_dir), "no_l2": make_engine(args, None)}
        rounds = [run_round(args, arms, r) for r in range(args.rounds)]
        l2_stats = arms["l2"].cache.l2_stats()  # type: ignore[attr-defined]
    result = summarize(args, rounds, l2_stats)
    result["load"] = (
        f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
        f"end, on {os.cpu_count()} cores shared with other work"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def make_engine(args: argparse.Namespace, l2_dir: str | None) -> Engine:
    from radixlm.cache.l2.cache import TieredRadixCache
    from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig
    from radixlm.engine.engine import Engine

    engine = Engine(
        ModelConfig(dtype=args.dtype, num_threads=args.threads),  # type: ignore[arg-type]
        CacheConfig(num_slots=args.num_slots, l2_dir=l2_dir, l2_capacity=1 << 16),
        SchedulerConfig(),
    )
    if (l2_dir is not None) != isinstance(engine.cache, TieredRadixCache):
        raise SystemExit("the L2 arm has no L2 tier (see the log)")
    run_requests(engine, [[TOKEN_RANGE[0] + i for i in range(32)]], 2)  # first-call costs
    return engine


def run_round(args: argparse.Namespace, arms: dict[str, Engine], index: int) -> dict[str, Any]:
    rng = random.Random(index)
    words = lambda n: [rng.randrange(*TOKEN_RANGE) for _ in range(n)]  # noqa: E731
    firsts = [words(args.first_len) for _ in range(args.conversations)]
    news = [[words(args.turn_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    randoms = [words(args.random_len) for _ in range(args.random_requests)]
    order = list(arms) if index % 2 == 0 else list(reversed(arms))
    out: dict[str, Any] = {"order": order}
    for name in order:
        flush(arms[name])
        out[name] = {"multiturn": multiturn(args, arms[name], firsts, news)}
    for name in order:
        flush(arms[name])
        out[name]["random"] = random_load(args, arms[name], randoms)
        arms[name].cache.check_integrity()
    for workload in ("multiturn", "random"):
        out[f"{workload}_outputs_identical"] = out["l2"][workload].pop("outputs") == out["no_l2"][
            workload
        ].pop("outputs")
    ttft = [out[a]["multiturn"]["followup_ttft_ms"] for a in ("l2", "no_l2")]
    tok_s = [out[a]["random"]["output_tok_s"] for a in ("l2", "no_l2")]
    print(f"round {index}: turn 3+ TTFT {ttft[0]:.0f} / {ttft[1]:.0f} ms, random "
          f"{tok_s[0]:.1f} / {tok_s[1]:.1f} tok/s (L2 / no L2)", file=sys.stderr)  # fmt: skip
    return out


def multiturn(
    args: argparse.Namespace, engine: Engine, firsts: list[list[int]], news: list[list[list[int]]]
) -> dict[str, Any]:
    histories = [list(f) for f in firsts]
    ttft_ms: list[list[float]] = [[] for _ in range(args.turns)]  # per turn
    outputs = []
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            if turn:
                history += news[c][turn]
            [(ttft, output)] = run_requests(engine, [history], args.output_len)
            ttft_ms[turn].append(ttft * 1000)
            outputs.append(output)
            history += output
    later = [t for turn in ttft_ms[2:] for t in turn]
    return {
        "first_ttft_ms": statistics.median(ttft_ms[0]),
        "second_turn_ttft_ms": statistics.median(ttft_ms[1]),
        "followup_ttft_ms": statistics.median(later),  # turns 3+: their history was written
        "ttft_ms_by_turn": ttft_ms,
        "outputs": outputs,
    }


def random_load(args: argparse.Namespace, engine: Engine, prompts: list[list[int]]) -> dict:
    start = time.perf_counter()
    results = run_requests(engine, prompts, args.random_output_len)
    elapsed = time.perf_counter() - start
    outputs = [o for _, o in results]
    return {"output_tok_s": sum(map(len, outputs)) / elapsed, "duration_s": elapsed,
            "outputs": outputs}  # fmt: skip


def run_requests(
    engine: Engine, prompts: list[list[int]], output_len: int
) -> list[tuple[float, list[int]]]:
    """Submit every prompt at once and step until done: (TTFT s, output ids) per prompt."""
    from radixlm.api_types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    reqs = [engine.requests(engine.add_request(p, params))[0] for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [(r.first_token_time - r.arrival_time, list(r.output_ids)) for r in reqs]


def flush(engine: Engine) -> None:
    from radixlm.cache.l2.cache import TieredRadixCache

    engine.cache.flush()
    if isinstance(engine.cache, TieredRadixCache):
        engine.cache.tree.flush_l2()


def summarize(
    args: argparse.Namespace, rounds: list[dict[str, Any]], l2_stats: dict[str, Any]
) -> dict[str, Any]:
    from radixlm.bench.host import describe_host

    def med(arm: str, workload: str, key: str) -> float:
        return statistics.median(r[arm][workload][key] for r in rounds)

    ttft_ratio = [
        r["no_l2"]["multiturn"]["followup_ttft_ms"] / r["l2"]["multiturn"]["followup_ttft_ms"]
        for r in rounds
    ]
    tok_s_ratio = [
        r["l2"]["random"]["output_tok_s"] / r["no_l2"]["random"]["output_tok_s"] for r in rounds
    ]
    return {
        "command": "python benchmarks/l2_served.py " + " ".join(sys.argv[1:]),
        "host": describe_host(),
        "model": f"default (SmolLM2-135M-Instruct Q4_1), {args.dtype}",
        "params": {k: v for k, v in vars(args).items() if k != "json"},
        "followup_ttft_ms": {"l2": med("l2", "multiturn", "followup_ttft_ms"),
                             "no_l2": med("no_l2", "multiturn", "followup_ttft_ms")},
        "first_ttft_ms": {"l2": med("l2", "multiturn", "first_ttft_ms"),
                          "no_l2": med("no_l2", "multiturn", "first_ttft_ms")},
        "second_turn_ttft_ms": {"l2": med("l2", "multiturn", "second_turn_ttft_ms"),
                                "no_l2": med("no_l2", "multiturn", "second_turn_ttft_ms")},
        "followup_ttft_speedup_median": statistics.median(ttft_ratio),
        "random_output_tok_s": {"l2": med("l2", "random", "output_tok_s"),
                                "no_l2": med("no_l2", "random", "output_tok_s")},
        "random_tok_s_ratio_median": statistics.median(tok_s_ratio),
        "outputs_identical": all(
            r["multiturn_outputs_identical"] and r["random_outputs_identical"] for r in rounds
        ),
        "l2_counters": {k: v for k, v in l2_stats.items() if k != "load_seconds_buckets"},
        "rounds": rounds,
    }  # fmt: skip


def render_section(result: dict[str, Any], host_line: str) -> str:
    """The docs/benchmarks.md section (benchmarks/render_docs.py calls it)."""
    p, ttft, tok_s = result["params"], result["followup_ttft_ms"], result["random_output_tok_s"]
    second = result["second_turn_ttft_ms"]
    rounds = len(result["rounds"])
    return "\n".join([
        f"`{result['command']}` runs two engines side by side on {result['model']}, each with a "
        f"{p['num_slots']:,}-slot KV pool, one with an L2 page file and one without; "
        f"{rounds} rounds, alternating which arm goes first, medians of the per-round ratios "
        "([cache.md](cache.md#the-served-l2-tier)). **multiturn**: "
        f"{p['conversations']} conversations of a {p['first_len']:,}-token first prompt, "
        f"{p['turns']} turns of {p['turn_len']} new tokens, taken round-robin one request at a "
        "time, so each conversation's KV has left RAM when it returns. **random**: "
        f"{p['random_requests']} unrelated {p['random_len']}-token prompts at once, "
        f"{p['random_output_len']} output tokens each.\n",
        "| | with L2 | without L2 | ratio |",
        "|---|---:|---:|---:|",
        f"| multiturn TTFT, turns 3+ (median) | {ttft['l2']:,.0f} ms | {ttft['no_l2']:,.0f} ms "
        f"| {result['followup_ttft_speedup_median']:.1f}x lower |",
        f"| multiturn TTFT, turn 2 (not written) | {second['l2']:,.0f} ms "
        f"| {second['no_l2']:,.0f} ms | |",
        f"| random output tok/s | {tok_s['l2']:.1f} | {tok_s['no_l2']:.1f} "
        f"| {result['random_tok_s_ratio_median']:.2f} |",
        "",
        f"Greedy outputs identical in both arms: {'yes' if result['outputs_identical'] else 'NO'}."
        f" {host_line}{'; ' + result['load'] if result.get('load') else ''}.\n",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
