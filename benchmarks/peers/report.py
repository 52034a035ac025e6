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

from engines import ENGINES, HERE, WORKLOADS

# servers whose usage carries no cached-token count
NO_CACHED_COUNT = {"llama-cpp-python": "not reported", "transformers": "– (no cache)"}
FAMILIES = ["radixlm", "llama-server", "llama-cpp-python", "vllm", "transformers"]
COLORS = {"radixlm": "#d62728", "llama-server": "#1f77b4", "llama-cpp-python": "#17becf",
          "vllm": "#2ca02c", "transformers": "#7f7f7f"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=HERE / "results" / "runs")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    runs = load(args.runs)
    best = best_per_family(runs)
    quickest = best_per_family(runs, "followup_ttft_p50_ms", lowest=True)
    (args.out / "table.md").write_text(full_table(runs) + "\n" + versus_table(best, quickest))
    plot(best, quickest, args.out)
    print((args.out / "table.md").read_text())


def load(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(engine name, workload) -> the run's JSON, in ENGINES order."""
    runs = {}
    for path in sorted(folder.glob("*.json")):
        run = json.loads(path.read_text())
        runs[(run["engine"]["name"], path.stem.split("__")[-1])] = run
    engines, workloads = list(ENGINES), list(WORKLOADS)
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
    best: dict[tuple[str, str], tuple[str, Any]], quickest: dict[tuple[str, str], tuple[str, Any]]
) -> str:
    """radixlm's throughput over each peer's best setting, and its follow-up TTFT against the
    peer setting with the quickest follow-ups (named when it is another one)."""
    lines = [
        "| workload | peer (best setting) | peer tok/s | radixlm tok/s | radixlm / peer "
        "| follow-up TTFT p50, peer's quickest / radixlm (ms) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload in WORKLOADS:
        if ("radixlm", workload) not in best:
            continue
        ours = best[("radixlm", workload)][1]["summary"]
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
    best: dict[tuple[str, str], tuple[str, Any]],
    quickest: dict[tuple[str, str], tuple[str, Any]],
    out: Path,
) -> None:
    """Grouped bars per workload, one bar per engine family at its best setting."""
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
        workloads = [w for w in WORKLOADS if any((f, w) in chosen for f in FAMILIES)]
        fig, ax = plt.subplots(figsize=(9, 4.2))
        width = 0.8 / len(FAMILIES)
        for k, fam in enumerate(FAMILIES):
            xs, ys = [], []
            for i, w in enumerate(workloads):
                if (fam, w) in chosen:
                    xs.append(i + (k - (len(FAMILIES) - 1) / 2) * width)
                    ys.append(chosen[(fam, w)][1]["summary"][key])
            ax.bar(xs, ys, width, label=fam, color=COLORS[fam])
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(f"SmolLM2-135M on 2 CPU cores, 8 in flight: {title}", fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8, ncol=len(FAMILIES), loc="upper center", bbox_to_anchor=(0.5, -0.08))
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)


def _ms(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.0f}"


if __name__ == "__main__":
    main()
