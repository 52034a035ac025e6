"""docs/benchmarks.md's sections on the served path: follow-up TTFT and its timeline
(`radixlm bench serve --workload followup --timeline`), speculation on and off
(benchmarks/speculation.py) and a neighbour's latency beside maximal requests
(benchmarks/neighbour_latency.py). Each reads the JSON its benchmark wrote; render_docs.py calls
them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
TOP_STAGES = 6  # the timeline's costliest stages shown, besides forward


def _recorded(name: str) -> dict[str, Any] | None:
    path = BENCH / name
    return json.loads(path.read_text()) if path.exists() else None


def _not_run(command: str) -> str:
    return f"No run recorded yet (`{command}`).\n"


def _host(host: dict[str, Any] | None) -> str:
    if not host:
        return "host not recorded"
    isa = " ".join(host.get("isa", []))
    line = f"{host.get('cpu', '?')}, {host.get('cores', '?')} cores, {isa}"
    return line + (f", at commit {host['commit']}" if host.get("commit") else "")


def followup_section() -> str:
    runs = [(c, _recorded(f"followup_c{c}.json")) for c in (1, 8)]
    runs = [(c, r) for c, r in runs if r is not None]
    if not runs:
        return _not_run("radixlm bench serve --workload followup --timeline --json ...")
    lines = [
        "`python -m radixlm bench serve --workload followup --param num_conversations=8 "
        "--prompt-format chat --timeline --concurrency C --json docs/bench/followup_cC.json` "
        "against `radixlm serve` (the default model and dtype: Q4_1 blocks, exact numerics, "
        "bfloat16 on AVX512-BF16): 8 conversations with a 1,000-token history, then 4 short "
        "turns each, every one an extend over its history cached. TTFT through HTTP, streamed; "
        "the timeline's stages are medians over the follow-ups (the stages add up to TTFT); "
        "served efficiency: the engine's forward seconds over the run's wall seconds.\n",
        "| streams | follow-up TTFT p50 / p99 | new / cached tokens (medians) | forward (p50) "
        "| everything else (p50) | costliest other stages (p50) | served efficiency | host |",
        "|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for c, r in runs:
        s = r["summary"]
        stages = s["followup_timeline"]["stages_ms"]
        forward = stages["forward"]["p50"]
        rest = s["followup_timeline"]["first_token_ms"]["p50"] - forward
        others = sorted(
            ((k, v["p50"]) for k, v in stages.items() if k != "forward" and v),
            key=lambda kv: -kv[1],
        )[:TOP_STAGES]
        lines.append(
            f"| {c} | {s['followup_ttft_p50_ms']:.1f} / {s['followup_ttft_p99_ms']:.1f} ms "
            f"| {s['followup_new_tokens_p50']:.0f} / {s['followup_cached_tokens_p50']:,.0f} "
            f"| {forward:.1f} ms | {rest:.1f} ms "
            f"| {', '.join(f'{k} {v:.2f}' for k, v in others)} "
            f"| {s['served_efficiency']:.0%} | {_host(r.get('host'))} |"
        )
    return "\n".join(lines) + "\n"


def speculation_section() -> str:
    r = _recorded("speculation.json")
    if r is None:
        return _not_run("python benchmarks/speculation.py --json docs/bench/speculation.json")
    lines = [
        "`python benchmarks/speculation.py --json docs/bench/speculation.json`: "
        f"{r['model']}, {r['threads']} threads, a fresh `radixlm serve` per run, `--speculate "
        "off` then `auto` side by side per workload (benchmarks/speculation_workload.py); "
        "tokens per decode forward = output tokens over the forwards that made them; outputs "
        f"compared token for token ({_host(r.get('host'))}):\n",
        "| workload | off, output tok/s | auto, output tok/s | auto / off | tokens per decode "
        "forward | draft tokens kept | identical outputs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, w in r["workloads"].items():
        off, auto = w["runs"]["off"], w["runs"]["auto"]
        drafted = auto["drafted_tokens"]
        kept = f"{auto['accepted_tokens'] / drafted:.0%} of {drafted:,}" if drafted else "none"
        lines.append(
            f"| {name} | {off['output_tok_s']:.1f} | {auto['output_tok_s']:.1f} "
            f"| {w['summary']['speedup']:.2f}x | {1 / auto['forwards_per_output_token']:.2f} "
            f"| {kept} | {w['summary']['identical_outputs']} |"
        )
    return "\n".join(lines) + "\n"


def neighbour_section() -> str:
    """One table per host that ran it: neighbour_latency.json, and neighbour_latency_<host>.json
    from hosts of another CPU."""
    runs = sorted(BENCH.glob("neighbour_latency*.json"))
    if not runs:
        return _not_run("python benchmarks/neighbour_latency.py --json ...")
    return "\n".join(_neighbour_table(path.name) for path in runs)


def _neighbour_table(name: str) -> str:
    r = _recorded(name)
    assert r is not None  # listed by neighbour_section
    scenarios = r["scenarios"]
    lines = [
        "`python benchmarks/neighbour_latency.py --rounds 3 --json "
        f"docs/bench/{name}`: `radixlm serve` (float32, "
        f"{r.get('num_threads', 1)} thread, `{r.get('serve_args') or 'defaults'}`) streams a "
        "neighbour's greedy chat alone, then beside "
        "one request with fields at their allowed maximum (benchmarks/neighbour_latency.py "
        "describes each); its inter-token latency beside over alone, the median over rounds. "
        "`plain` is the control: a long decode with no special field, which a neighbour shares "
        f"every step with ({_host(r.get('host'))}):\n",
        "| beside | median ITL, beside / alone | worst ITL, beside / alone | median vs plain |",
        "|---|---:|---:|---:|",
    ]
    plain = scenarios.get("plain", {}).get("ratio_median")
    for key, s in scenarios.items():
        if "ratio_median" not in s:
            continue
        versus = f"{s['ratio_median'] / plain:.2f}x" if plain else "–"
        lines.append(f"| {key} | {s['ratio_median']:.2f}x | {s['ratio_max']:.2f}x | {versus} |")
    return "\n".join(lines) + "\n"
