"""Table and plots of the comparison, from results/runs/*.json (written by run.py).

    .venv/bin/python benchmarks/peers/report.py [--runs DIR] [--out DIR]

Writes results/table.md (every engine setting × workload, then radixlm against each peer's best
setting per workload) and results/throughput.png, results/ttft.png.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from engines import ENGINES, HERE, SERVED, WORKLOADS

# servers whose usage carries no cached-token count
NO_CACHED_COUNT = {"llama-cpp-python": "not reported", "transformers": "– (no cache)"}
FAMILIES = ["radixlm", "llama-server", "llama-cpp-python", "vllm", "transformers"]
# radixlm's settings, each reported on its own: float32 (the default, same numbers as
# transformers) and bfloat16
OURS = ["radixlm", "radixlm --dtype bfloat16"]
COLORS = {"radixlm": "#d62728", "llama-server": "#1f77b4", "llama-cpp-python": "#17becf",
          "vllm": "#2ca02c", "transformers": "#7f7f7f"}  # fmt: skip
OUR_COLORS = ["#d62728", "#ff9896"]  # float32, bfloat16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=HERE / "results" / "runs")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    runs = load(args.runs)
    peers = {k: v for k, v in runs.items() if family(k[0]) != "radixlm"}
    best = best_per_family(peers)
    quickest = best_per_family(peers, "followup_ttft_p50_ms", lowest=True)
    tables = [full_table(runs)]
    for ours in OURS:  # the default first; each radixlm setting against the peers' best
        if any(engine == ours for engine, _ in runs):
            tables.append(f"**{ours}** against each peer's best setting:\n\n")
            tables[-1] += versus_table(runs, ours, best, quickest)
    (args.out / "table.md").write_text("\n".join(tables))
    plot(runs, best, quickest, args.out)
    print((args.out / "table.md").read_text())


def load(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(engine name, workload) -> the run's JSON, in ENGINES order."""
    runs = {}
    for path in sorted(folder.glob("*.json")):
        run = json.loads(path.read_text())
        runs[(run["engine"]["name"], path.stem.split("__")[-1])] = run
    engines, workloads = list(ENGINES), [*WORKLOADS, *SERVED]
    return dict(
        sorted(runs.items(), key=lambda kv: (engines.index(kv[0][0]), workloads.index(kv[0][1])))
    )


def family(engine: str) -> str:
    return next(f for f in FAMILIES if engine.startswith(f))


def best_per_family(
    runs: dict[tuple[str, str], Any], key: str = "output_tok_s", lowest: bool = False
) -> dict[tuple[str, str], tuple[str, Any]]:
    """(family, workload) -> (engine setting, run) with the highest (or lowest) summary[key]."""
    best: dict[tuple[str, str], tuple[str, Any]] = {}
    for (engine, workload), run in runs.items():
        value = run["summary"].get(key)
        if value is None or math.isnan(value):
            continue
        slot = (family(engine), workload)
        if slot not in best or (value < best[slot][1]["summary"][key]) == lowest:
            best[slot] = (engine, run)
    return best


def full_table(runs: dict[tuple[str, str], Any]) -> str:
    lines = [
        "| engine setting | workload | output tok/s | req/s | TTFT p50 / p99 (ms) "
        "| follow-up TTFT p50 (ms) | ITL p50 (ms) | cached prompt tokens | other cores busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (engine, workload), run in runs.items():
        s, c = run["summary"], run["contention"]
        hit = f"{s['cached_tokens'] / s['prompt_tokens']:.0%}"
        if family(engine) in NO_CACHED_COUNT:
            hit = NO_CACHED_COUNT[family(engine)]
        lines.append(
            f"| {engine} | {workload} | {s['output_tok_s']:.1f} | {s['request_s']:.2f} "
            f"| {s['ttft_p50_ms']:,.0f} / {s['ttft_p99_ms']:,.0f} "
            f"| {_ms(s.get('followup_ttft_p50_ms'))} | {_ms(s.get('itl_p50_ms'))} | {hit} "
            f"| {c['other_busy_cores']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def versus_table(
    runs: dict[tuple[str, str], Any],
    ours_engine: str,
    best: dict[tuple[str, str], tuple[str, Any]],
    quickest: dict[tuple[str, str], tuple[str, Any]],
) -> str:
    """One radixlm setting's throughput over each peer's best setting, and its follow-up TTFT
    against the peer setting with the quickest follow-ups (named when it is another one)."""
    lines = [
        "| workload | peer (best setting) | peer tok/s | radixlm tok/s | radixlm / peer "
        "| follow-up TTFT p50, peer's quickest / radixlm (ms) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload in WORKLOADS:
        if (ours_engine, workload) not in runs:
            continue
        ours = runs[(ours_engine, workload)]["summary"]
        for fam in FAMILIES[1:]:
            if (fam, workload) not in best:
                continue
            engine, run = best[(fam, workload)]
            s = run["summary"]
            ratio = ours["output_tok_s"] / s["output_tok_s"]
            follow = ""
            if (fam, workload) in quickest and "followup_ttft_p50_ms" in ours:
                q_engine, q_run = quickest[(fam, workload)]
                theirs = q_run["summary"]["followup_ttft_p50_ms"]
                follow = (
                    f"{_ms(theirs)} / {_ms(ours['followup_ttft_p50_ms'])} "
                    f"({theirs / ours['followup_ttft_p50_ms']:.1f}x)"
                    + (f" [{q_engine}]" if q_engine != engine else "")
                )
            lines.append(
                f"| {workload} | {engine} | {s['output_tok_s']:.1f} | {ours['output_tok_s']:.1f} "
                f"| {ratio:.2f}x | {follow} |"
            )
    return "\n".join(lines) + "\n"


def plot(
    runs: dict[tuple[str, str], Any],
    best: dict[tuple[str, str], tuple[str, Any]],
    quickest: dict[tuple[str, str], tuple[str, Any]],
    out: Path,
) -> None:
    """Grouped bars per workload: one per radixlm setting, one per peer family at its best."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("throughput.png", "output tokens/s (higher is better)", "output_tok_s", False, best),
        ("ttft.png", "TTFT p50, ms (log; lower is better)", "ttft_p50_ms", True, best),
        ("followup_ttft.png", "follow-up TTFT p50, ms (log; lower is better)",
         "followup_ttft_p50_ms", True, quickest),
    ]  # fmt: skip
    for filename, title, key, log, chosen in panels:
        bars: list[tuple[str, str, dict[str, float]]] = []  # (label, color, workload -> value)
        for k, ours in enumerate(OURS):
            values = {w: r["summary"].get(key) for (e, w), r in runs.items() if e == ours}
            bars.append((ours, OUR_COLORS[k], values))
        for fam in FAMILIES[1:]:
            values = {w: run["summary"].get(key) for (f, w), (_, run) in chosen.items() if f == fam}
            bars.append((fam, COLORS[fam], values))
        bars = [b for b in bars if any(v is not None for v in b[2].values())]
        workloads = [w for w in WORKLOADS if any(b[2].get(w) is not None for b in bars)]
        fig, ax = plt.subplots(figsize=(10, 4.4))
        width = 0.8 / len(bars)
        for k, (label, color, values) in enumerate(bars):
            xs = [i + (k - (len(bars) - 1) / 2) * width for i, w in enumerate(workloads)]
            ys = [values.get(w) for w in workloads]
            kept = [(x, y) for x, y in zip(xs, ys) if y is not None and not math.isnan(y)]
            ax.bar([x for x, _ in kept], [y for _, y in kept], width, label=label, color=color)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(f"SmolLM2-135M on 2 CPU cores, 8 in flight: {title}", fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8, ncol=len(bars), loc="upper center", bbox_to_anchor=(0.5, -0.08))
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)


def _ms(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.0f}"


if __name__ == "__main__":
    main()
