"""Tables and plots for the engine benchmarks (rich for the terminal, matplotlib for PNGs)."""

from __future__ import annotations

from typing import Any

# (JSON key, column title, format)
OFFLINE_COLUMNS = [
    ("requests", "requests", "{:d}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("token_hit_rate", "hit rate", "{:.1%}"),
    ("prefill_tokens", "prefill tok", "{:d}"),
    ("ideal_prefill_tokens", "ideal", "{:d}"),
    ("prefill_over_ideal", "prefill/ideal", "{:.3f}"),
]


def print_offline(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench offline: {results['workload']} {results['params']}")
    table.add_column("cache")
    for _, title, _ in OFFLINE_COLUMNS:
        table.add_column(title, justify="right")
    modes = results["modes"]
    for mode, row in modes.items():
        table.add_row(mode, *(fmt.format(row[key]) for key, _, fmt in OFFLINE_COLUMNS))
    console = Console()
    console.print(table)
    if "radix" in modes and "none" in modes:
        speedup = modes["radix"]["requests_per_s"] / modes["none"]["requests_per_s"]
        console.print(f"radix / none throughput: [bold]{speedup:.2f}x[/bold]")


def plot_offline(results: dict[str, Any], path: str) -> None:
    """Three panels, radix beside none: throughput, TTFT p50/p99, prefill tokens vs ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    names = list(modes)
    colors = {"radix": "tab:blue", "none": "tab:gray"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [modes[m]["output_tokens_per_s"] for m in names],
                color=[colors.get(m, "tab:green") for m in names])  # fmt: skip
    axes[0].set_title("output tokens/s (higher is better)")
    width = 0.35
    for i, m in enumerate(names):
        xs = [j + (i - 0.5) * width for j in range(2)]
        vals = [modes[m]["ttft_p50_ms"], modes[m]["ttft_p99_ms"]]
        axes[1].bar(xs, vals, width, label=m, color=colors.get(m, "tab:green"))
    axes[1].set_xticks([0, 1], ["p50", "p99"])
    axes[1].set_title("TTFT ms (lower is better)")
    axes[1].legend()
    axes[2].bar(names, [modes[m]["prefill_tokens"] for m in names],
                color=[colors.get(m, "tab:green") for m in names])  # fmt: skip
    ideal = modes[names[0]]["ideal_prefill_tokens"]
    axes[2].axhline(ideal, color="tab:red", linestyle="--", label=f"ideal {ideal}")
    axes[2].set_title("prefill tokens computed")
    axes[2].legend()
    fig.suptitle(f"radixlm bench offline: {results['workload']} {results['params']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
