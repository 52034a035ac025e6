"""docs/benchmarks.md and the README's headline table, regenerated from the benchmarks' JSON.

    .venv/bin/python benchmarks/render_docs.py          # rewrite both
    .venv/bin/python benchmarks/render_docs.py --check  # exit 1 if either is stale

A new run is a new JSON file and a rerun of this script, never a hand edit: the sources are
docs/bench/offline_*.json (`radixlm bench offline`), docs/bench/model_*.json (`radixlm bench
model`), docs/bench/cache_vs_sglang.jsonl (`benchmarks/cache_compare.py`) and
benchmarks/peers/results/runs*/*.json (`benchmarks/peers/run.py`). Every table names the CPU its
figures were measured on, from the "host" record in each file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "docs" / "bench"
RUNS = REPO / "benchmarks" / "peers" / "results" / "runs"
RUNS_AVX2 = RUNS.with_name("runs-avx2")  # `run.py --isa avx2`
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "benchmarks" / "peers")]

import render_serving  # noqa: E402  (benchmarks/render_serving.py)
import report as peers  # noqa: E402  (benchmarks/peers/report.py)
from engines import ISA_CAPS  # noqa: E402  (benchmarks/peers/engines.py)

from radixlm.bench.host import cpu_label  # noqa: E402

BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"
SPEED = ("<!-- speed:begin -->", "<!-- speed:end -->")
OURS = [
    ("radixlm", "radixlm float32"),
    ("radixlm --dtype bfloat16", "radixlm bfloat16 (`--dtype auto` on AVX512-BF16)"),
]
PEER_LABELS = {
    "llama-server": "llama.cpp `llama-server`",
    "llama-cpp-python": "llama-cpp-python",
    "vllm": "vLLM CPU 0.32",
    "transformers": "transformers `generate`",
}
OFFLINE_ORDER = ["gsp", "fewshot", "agent", "tot", "multiturn", "random"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is out of date")
    args = parser.parse_args()
    readme_path, page_path = REPO / "README.md", REPO / "docs" / "benchmarks.md"
    readme = splice(readme_path.read_text(), headline_table(peers.load(RUNS)))
    readme = splice(readme, speed_table(), *SPEED)
    page = benchmarks_page()
    pages = ((readme_path, readme), (page_path, page))
    stale = [p for p, text in pages if not p.exists() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO)} is stale: run benchmarks/render_docs.py")
        return 1 if stale else 0
    readme_path.write_text(readme)
    page_path.write_text(page)
    return 0


# ---- the README's headline ------------------------------------------------------------------
def headline_table(runs: dict[tuple[str, str], Any]) -> str:
    """Output tok/s of each engine at its best setting per workload, radixlm's two dtypes first;
    in brackets the radixlm row of the same dtype over the peer (vLLM float32 against our
    float32, vLLM bfloat16 against our bfloat16, every other peer against our float32)."""
    workloads = [w for w in peers.WORKLOADS if any(wl == w for _, wl in runs)]
    best = peers.best_per_family({k: v for k, v in runs.items() if k[0] not in dict(OURS)})
    lines = [
        "| output tok/s, 8 streams | " + " | ".join(workloads) + " |",
        "|---|" + "---:|" * len(workloads),
    ]
    for engine, label in OURS:
        cells = [_tok(runs.get((engine, w))) for w in workloads]
        lines.append(f"| **{label}** | " + " | ".join(f"**{c}**" for c in cells) + " |")
    rows: list[tuple[str, str]] = [
        ("vllm", "vLLM CPU 0.32, float32"),
        ("vllm --dtype bfloat16", "vLLM CPU 0.32, bfloat16"),
    ]
    for engine, label in rows:
        ours = "radixlm --dtype bfloat16" if "bfloat16" in engine else "radixlm"
        cells = [_versus(runs.get((ours, w)), runs.get((engine, w))) for w in workloads]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for fam in ("llama-server", "llama-cpp-python", "transformers"):
        if not any(f == fam for f, _ in best):
            continue
        cells = []
        for w in workloads:
            engine_run = best.get((fam, w))
            cells.append(_versus(runs.get(("radixlm", w)), engine_run and engine_run[1]))
        lines.append(f"| {PEER_LABELS[fam]} (best setting) | " + " | ".join(cells) + " |")
    hosts = {cpu_label(r.get("host")) for (e, _), r in runs.items() if e in dict(OURS)}
    caption = (
        f"SmolLM2-135M-Instruct, each engine serving it on 127.0.0.1 with 2 threads; "
        f"CPU: {'; '.join(sorted(hosts))}. In brackets: radixlm over that engine, radixlm "
        "bfloat16 against vLLM bfloat16 and radixlm float32 against the rest (llama.cpp serves "
        "the Q4_1 GGUF, the others its float32 dequantization)."
    )
    return "\n".join(lines) + "\n\n" + caption + "\n"


def splice(readme: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """The README with the text between the `begin` and `end` markers replaced by `table`."""
    if begin not in readme or end not in readme:
        raise SystemExit(f"README.md lacks the {begin} / {end} markers")
    head, rest = readme.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}{end}{tail}"


def speed_table() -> str:
    """One row per kernel variant and dtype from docs/bench/model_*.json: ours over
    transformers on the same weights, prefill and decode, with the CPU each was measured on."""
    lines = [
        "| kernels, dtype | prefill 128 / 1024 / 4096 tokens | decode batch 1 / 8 / 32 "
        "| prefill, of the matmul peak: ours / transformers | CPU, threads |",
        "|---|---|---|---|---|",
    ]
    for path in sorted(BENCH.glob("model_*.json")):
        r = json.loads(path.read_text())
        prefill = " / ".join(
            f"{x['ours_tok_s'] / x['transformers_tok_s']:.1f}x" for x in r["prefill"]
        )
        decode = " / ".join(f"{x['transformers_ms'] / x['ours_ms']:.1f}x" for x in r["decode"])
        threads = r.get("threads", "?")
        cpu = f"{cpu_label(r.get('host'))}; {threads} thread{'' if threads == 1 else 's'}"
        lines.append(
            f"| {r.get('isa', '?')}, {r.get('dtype', '?')} | {prefill} | {decode} "
            f"| {_peak_shares(r['prefill'])} | {cpu} |"
        )
    return (
        "\n".join(lines)
        + _quant_speed()
        + "\n\nSmolLM2-135M-Instruct; how many times faster than transformers on the same weights "
        "(`radixlm bench model`, one process, alternating rounds; decode with 1,024 tokens of "
        "context per request). The avx2 and generic rows force the variant with `RADIXLM_ISA` "
        "and cap PyTorch to the same instruction set. Prefill is compute-bound: the share of "
        "this host's matmul peak (a large `F.linear`, same threads, dtype and caps) bounds how "
        "far ahead of transformers any engine can get (1 / transformers' share): where that is "
        "under 1.5x, so is every engine's prefill. Per-row figures: "
        "[docs/benchmarks.md](docs/benchmarks.md#model-speed-against-transformers).\n"
    )


def _quant_speed() -> str:
    """The README's lines for the default numbers: the GGUF's blocks in the integer kernels
    (docs/bench/quant_<variant>.json) and llama.cpp on the same file (llamacpp_<variant>.json),
    or nothing before those runs."""
    runs = sorted(BENCH.glob("quant_*.json"))
    if not runs:
        return ""
    lines = [
        "\n\n| GGUF Q4_1 kept quantized (`--quant exact`, the default) | decode batch 1 / 8, "
        "1,024 tokens of context | share of the read bandwidth, batch 1 | prefill 1,024 tokens "
        "| against llama.cpp, decode | CPU, threads |",
        "|---|---|---|---|---|---|",
    ]
    for path in runs:
        r = json.loads(path.read_text())
        isa = r.get("isa", "?")
        decode = {row["batch"]: row for row in r["decode"]}
        prefill = {row["tokens"]: row for row in r["prefill"]}
        one = decode.get(1)
        ms = " / ".join(f"{decode[b]['ours_ms']:.1f} ms" for b in sorted(decode))
        share = f"{one['ours_roofline']:.0%} of {one['host_read_gb_s']:.0f} GB/s" if one else "–"
        tok_s = f"{prefill[1024]['ours_tok_s']:,.0f} tok/s" if 1024 in prefill else "–"
        versus = "–"
        llama = BENCH / path.name.replace("quant_", "llamacpp_", 1)  # the same host's run
        if llama.exists():
            versus = f"{json.loads(llama.read_text())['ours_vs_llamacpp_decode']['exact']:.2f}x"
        threads = r.get("threads", "?")
        forced = " (forced)" if (r.get("env") or {}).get("RADIXLM_ISA") else ""
        lines.append(
            f"| {isa}{forced}, {r.get('dtype', '?')} | {ms} | {share} | {tok_s} | {versus} "
            f"| {cpu_label(r.get('host'))}; {threads} threads; at {r.get('commit') or '?'} |"
        )
    note = (
        "\n\nEach row ran on the CPU it names, at the commit it names; a row is re-measured only "
        "on a host that can run its variant (`radixlm bench model --quant exact,fast,float`)."
    )
    return "\n".join(lines) + note


def _peak_shares(prefill: list[dict[str, Any]]) -> str:
    """Ours / transformers as shares of the matmul peak, on the prefill row nearest 1,024 tokens
    that recorded a peak ("–" for runs from before the roofline). That row, because there the
    layers' matmuls are most of the work; at 4,096 tokens causal attention is ~40 % of the
    FLOPs and runs in attention kernels, which the matmul peak does not bound."""
    rows = [x for x in prefill if "matmul_peak_gflop_s" in x and "transformers_gflop_s" in x]
    if not rows:
        return "–"
    x = min(rows, key=lambda row: abs(row["tokens"] - 1024))
    peak = x["matmul_peak_gflop_s"]
    return (
        f"{x['ours_gflop_s'] / peak:.0%} / {x['transformers_gflop_s'] / peak:.0%} "
        f"({x['tokens']:,} tokens)"
    )


# ---- docs/benchmarks.md -----------------------------------------------------------------------
def benchmarks_page() -> str:
    runs = peers.load(RUNS)
    parts = [
        "# Benchmarks\n",
        "<!-- Generated by benchmarks/render_docs.py from docs/bench/*.json and "
        "benchmarks/peers/results/runs/*.json: rerun it, do not edit. -->\n",
        "Every figure below is read from the JSON its benchmark wrote; each section names the "
        "command and the CPU. These hosts are shared and noisy: compare rows measured together, "
        "and read ratios to the nearest ~5 %.\n",
        "## Against other engines, served\n",
        "`benchmarks/peers/run.py` serves SmolLM2-135M-Instruct with each engine and drives it "
        "with the same client (`radixlm bench serve`: streamed `/v1/completions`, token-id "
        "prompts, greedy, 32 output tokens, EOS ignored, 8 requests in flight); setup, versions "
        "and pitfalls in [peers.md](peers.md).\n",
        headline_table({k: v for k, v in runs.items() if k[1] != "served"}),
        *_native_served(runs),
        "Every setting of every engine (`benchmarks/peers/report.py` draws the same data as "
        "plots in `benchmarks/peers/results/`):\n",
        peers.full_table(runs),
        "![throughput](../benchmarks/peers/results/throughput.png)\n",
        "### The same, every engine held to AVX2 + FMA\n",
        avx2_section(),
        "## The radix cache against no cache, in the engine\n",
        offline_section(),
        "## Quantized weights\n",
        quant_section(),
        "## Model speed against transformers\n",
        model_section(),
        "## Agent loops with tools\n",
        agents_section(),
        "## A follow-up turn, served\n",
        render_serving.followup_section(),
        "## Speculation: drafts from the tree, verified in the decode step\n",
        render_serving.speculation_section(),
        "## A neighbour beside requests at their bounds\n",
        render_serving.neighbour_section(),
        "## Eviction policies and a disk tier, on a production trace\n",
        tiers_section(),
        "### On traces they were not tuned on\n",
        traces_section(),
        "### The disk tier, served\n",
        l2_served_section(),
        "## Replicas behind a cache-aware gateway\n",
        replicas_section(),
        "## What cache reports cost\n",
        observatory_section(),
        "## The tree against SGLang's\n",
        sglang_section(),
    ]
    return "\n".join(parts)


def _native_served(runs: dict[tuple[str, str], Any]) -> list[str]:
    served = {k: v for k, v in runs.items() if k[1] == "served"}
    return [served_table(served, "run.py --workloads served --rounds N")] if served else []


def avx2_section() -> str:
    runs = peers.load(RUNS_AVX2)
    if not runs:
        return "No run recorded yet (`benchmarks/peers/run.py --isa avx2`).\n"
    served = {k: v for k, v in runs.items() if k[1] == "served"}
    runs = {k: v for k, v in runs.items() if k[1] != "served"}
    caps = next(iter(runs.values()))["engine"]["env"] if runs else {}
    caps = {k: v for k, v in caps.items() if k in ISA_CAPS["avx2"]}
    parts = [
        "`benchmarks/peers/run.py --isa avx2` ([peers.md](peers.md)): the same runs on the same "
        "host with every engine capped to AVX2 + FMA, as on a CPU without AVX-512: "
        + " ".join(f"`{k}={v}`" for k, v in caps.items())
        + " (radixlm's kernel variant, PyTorch, oneDNN, MKL, and vLLM's choice of its own "
        "kernel library: it loads `_C_AVX2`); llama-server built for AVX2 only "
        "(`install.sh llama-avx2`).\n",
    ]
    if runs:
        parts += [headline_table(runs), peers.full_table(runs)]
    if served:
        parts.append(
            "The served run's host line below names its CPU: on one without AVX-512 the caps "
            "change nothing and every engine runs its own AVX2 code, llama.cpp the xllamacpp "
            "wheel's (its runs forced on an AVX-512 host are kept in `runs-avx2/forced-zen4/`)."
        )
        parts.append(served_table(served))
    return "\n".join(parts)


def served_table(
    runs: dict[tuple[str, str], Any], command: str = "run.py --isa avx2 --workloads served"
) -> str:
    """The served run: one shared prefix, each engine against vLLM (bfloat16 where it ran, else
    float32). With rounds (`run.py --rounds N`), each row is the engine's median round and its
    ratio the median of the per-round ratios, each round's listed beside it."""
    base = "vllm --dtype bfloat16" if ("vllm --dtype bfloat16", "served") in runs else "vllm"
    vllm = runs.get((base, "served"))
    vllm_tok_s = vllm["summary"]["output_tok_s"] if vllm else None
    label = "vLLM bfloat16" if base != "vllm" else "vLLM float32"
    num_rounds = max(len(run.get("rounds", [])) for run in runs.values())
    intro = (
        f"Served run (`{command}`: one 1,200-token prefix shared by 16 "
        "requests of 80 own tokens each, 24 output tokens, 8 in flight)"
    )
    header = (
        f"| engine setting | output tok/s | over {label} | TTFT p50 / p99 (ms) "
        "| ITL p50 (ms) | cached prompt tokens | other cores busy |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if num_rounds > 1:
        intro += (
            f", {num_rounds} rounds (`--rounds {num_rounds}`: the engines alternate, each from a "
            "fresh server every round). A row is the engine's median round by output tok/s (the "
            f'lower middle one for an even count); "over {label}" is the median of the '
            "per-round ratios, which pair the rounds of the same index"
        )
        header += f" per round: output tok/s (over {label}) |"
        rule += "---|"
    lines = [intro + ":\n", header, rule]
    for (engine, _), run in runs.items():
        s, c = run["summary"], run["contention"]
        ratios = _round_ratios(run, vllm) if engine != base else []
        if ratios:
            ratio = f"{statistics.median(ratios):.2f}x"
        else:
            ratio = "–" if vllm_tok_s is None else f"{s['output_tok_s'] / vllm_tok_s:.2f}x"
            if vllm and run["config"].get("run_id") != vllm["config"].get("run_id"):
                ratio += " (separate run)"  # not measured side by side with this vLLM
        cells = [
            engine, f"{s['output_tok_s']:.1f}", ratio,
            f"{s['ttft_p50_ms']:,.0f} / {s['ttft_p99_ms']:,.0f}", f"{s['itl_p50_ms']:.0f}",
            f"{s['cached_tokens'] / s['prompt_tokens']:.0%}", f"{c['other_busy_cores']:.2f}",
        ]  # fmt: skip
        if num_rounds > 1:
            tok_s = [r["summary"]["output_tok_s"] for r in run.get("rounds", [])]
            cells.append(
                " · ".join(f"{t:.1f} ({x:.2f}x)" for t, x in zip(tok_s, ratios))
                if ratios
                else " · ".join(f"{t:.1f}" for t in tok_s) or "–"
            )
        lines.append("| " + " | ".join(cells) + " |")
    hosts = {_host_line(r.get("host")) for r in runs.values()}
    return "\n".join(lines) + "\n\n" + "; ".join(sorted(hosts)) + ".\n"


def _round_ratios(run: dict[str, Any], vllm: dict[str, Any] | None) -> list[float]:
    """`run`'s output tok/s over vLLM's, round by round, in `run`'s order: only for rounds of
    the same invocation (run_id) and index, so each ratio compares runs made side by side."""
    if vllm is None or run["config"].get("run_id") != vllm["config"].get("run_id"):
        return []
    theirs = {r["index"]: r["summary"]["output_tok_s"] for r in vllm.get("rounds", [])}
    ours = [r for r in run.get("rounds", []) if r["index"] in theirs]
    if len(ours) != len(run.get("rounds", [])):
        return []  # an unpaired round: the per-round list would mislead
    return [r["summary"]["output_tok_s"] / theirs[r["index"]] for r in ours]


def offline_section() -> str:
    results = {}
    for path in sorted(BENCH.glob("offline_*.json")):
        result = json.loads(path.read_text())
        results[result["workload"]] = result
    lines = [
        "`radixlm bench offline --workload W --cache both --json docs/bench/offline_W.json` "
        "runs one workload through the engine with the radix cache, then with none, in one "
        "process (default model, float32, all requests queued at once, greedy):\n",
        "| workload (parameters) | radix req/s | none req/s | radix / none "
        "| TTFT p50 radix / none | hit rate | prefill computed (radix / none / ideal) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    hosts = set()
    for name in sorted(results, key=lambda w: [*OFFLINE_ORDER, w].index(w)):
        result = results[name]
        radix, none = result["modes"]["radix"], result["modes"]["none"]
        params = ", ".join(f"{k}={v}" for k, v in result["params"].items())
        lines.append(
            f"| {name} ({params}) | {radix['requests_per_s']:.2f} | {none['requests_per_s']:.2f} "
            f"| {radix['requests_per_s'] / none['requests_per_s']:.2f}x "
            f"| {_s(radix['ttft_p50_ms'])} / {_s(none['ttft_p50_ms'])} "
            f"| {radix['token_hit_rate']:.1%} | {radix['prefill_tokens']:,} / "
            f"{none['prefill_tokens']:,} / {radix['ideal_prefill_tokens']:,} |"
        )
        hosts.add(_host_line(result.get("host")))
    lines.append("\n" + "; ".join(sorted(hosts)) + ".\n")
    return "\n".join(lines)


def model_section() -> str:
    blocks = [
        "`radixlm bench model --json docs/bench/model_<variant>.json` times ours and "
        "transformers on the same weights in one process, alternating rounds and keeping each "
        "side's best; decode with a 1,024-token context per request. One block per kernel "
        "variant (`RADIXLM_ISA`) and dtype.\n",
        "Each block's roofline table puts every side's prefill in GFLOP/s next to the host's "
        "matmul peak, a 2048 x 2048 x 2048 `F.linear` timed in the same alternating rounds "
        "(same process, threads, dtype and instruction-set caps). The FLOPs of a prefill of n "
        "tokens (`radixlm.bench.roofline.prefill_flops`; a multiply-add counts 2) are "
        "2 n x the layers' weight elements, plus 4 D x n (n + 1) / 2 per head and layer for "
        "causal attention, plus one logits row (2 x hidden x vocab): 0.21 GFLOP per token in "
        "the layers for SmolLM2-135M. A prefill runs at most at the peak, so peak / "
        "transformers' GFLOP/s is the most any engine can be ahead of it on that CPU.\n",
    ]
    for path in sorted(BENCH.glob("model_*.json")):
        result = json.loads(path.read_text())
        blocks.append(_model_block(path.name, result))
    return "\n".join(blocks)


def _model_block(name: str, result: dict[str, Any]) -> str:
    variant = result.get("isa") or result.get("variant") or "native"
    extra = "pytorch_tok_s" in json.dumps(result)
    head = "| | ours | transformers | ours / transformers |" + (" PyTorch path |" if extra else "")
    lines = [
        f"**{variant}, {result.get('dtype', 'float32')}** ([`{name}`](bench/{name}); "
        f"{_host_line(result.get('host'))}, {result.get('threads', '?')} threads"
        f"{_env_note(result.get('env'))}):\n",
        head,
        "|---|---:|---:|---:|" + ("---:|" if extra else ""),
    ]
    for row in result["prefill"]:
        ours, theirs = row["ours_tok_s"], row["transformers_tok_s"]
        cells = [f"prefill {row['tokens']} tokens", f"{ours:,.0f} tok/s", f"{theirs:,.0f} tok/s"]
        cells.append(f"{ours / theirs:.1f}x")
        if extra:
            cells.append(_opt(row.get("pytorch_tok_s"), "{:,.0f} tok/s"))
        lines.append("| " + " | ".join(cells) + " |")
    for row in result["decode"]:
        ours, theirs = row["ours_ms"], row["transformers_ms"]
        gb_s = f" ({row['ours_gb_s']:.0f} GB/s)" if "ours_gb_s" in row else ""
        cells = [f"decode batch {row['batch']}", f"{ours:.1f} ms{gb_s}", f"{theirs:.1f} ms"]
        cells.append(f"{theirs / ours:.1f}x")
        if extra:
            cells.append(_opt(row.get("pytorch_ms"), "{:.1f} ms"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + _roofline_block(result["prefill"])


def _roofline_block(prefill: list[dict[str, Any]]) -> str:
    """Prefill GFLOP/s per side with its share of the matmul peak, and the ceiling over
    transformers (peak / theirs); empty for runs that recorded no peak."""
    rows = [x for x in prefill if "matmul_peak_gflop_s" in x]
    if not rows:
        return ""
    sides = [s for s in ("ours", "pytorch", "transformers") if f"{s}_gflop_s" in rows[0]]
    names = {"ours": "ours", "pytorch": "PyTorch path", "transformers": "transformers"}
    lines = [
        "\n| prefill | GFLOP | matmul peak, GFLOP/s | "
        + " | ".join(f"{names[s]}, GFLOP/s (of peak)" for s in sides)
        + " | ceiling over transformers |",
        "|---|---:|---:|" + "---:|" * len(sides) + "---:|",
    ]
    for x in rows:
        peak = x["matmul_peak_gflop_s"]
        cells = [f"{x['tokens']:,} tokens", f"{x['gflop']:,.0f}", f"{peak:.0f}"]
        cells += [f"{x[f'{s}_gflop_s']:.0f} ({x[f'{s}_gflop_s'] / peak:.0%})" for s in sides]
        theirs = x.get("transformers_gflop_s")
        cells.append("–" if theirs is None else f"{peak / theirs:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


QUANT_SIDES = [("ours", "exact (default)"), ("ours_fast", "fast"), ("ours_float", "float")]


def quant_section() -> str:
    """The GGUF's blocks in the integer kernels, per numerics and variant
    (docs/bench/quant_<variant>.json: `radixlm bench model --quant exact,fast,float`), and
    against llama.cpp on the same file (docs/bench/llamacpp_<variant>.json)."""
    runs = sorted(BENCH.glob("quant_*.json"))
    if not runs:
        return _not_run("radixlm bench model --quant exact,fast,float")
    blocks = [
        "`radixlm bench model --quant exact,fast,float --json docs/bench/quant_<variant>.json` "
        "runs the default model's Q4_1 / Q8_0 blocks in the integer kernels (exact: int16 "
        "activations, the default; fast: int8) and, as `float`, the same file dequantized to "
        "the dtype; one process, alternating rounds, each side's best. A decode step's bytes "
        "are the weights as each side holds them plus the K/V of its context; the read "
        "bandwidth is a 512 MiB sum timed in the same rounds, so the last figure is the share "
        "of the memory roofline a step reaches.\n",
    ]
    for path in runs:
        blocks.append(_quant_block(path.name, json.loads(path.read_text())))
    big = sorted(BENCH.glob("model8b_quant_*.json"))
    if big:
        blocks.append(
            "A Llama-3-8B shape in Q4_K_M (`python -m radixlm.bench.random_gguf llama-8b FILE "
            "--type Q4_K_M`: random blocks, llama.cpp's mix of Q4_K and Q6_K), "
            "`radixlm bench model --model FILE --quant exact`:\n"
        )
    for path in big:
        blocks.append(_quant_block(path.name, json.loads(path.read_text())))
    for path in sorted(BENCH.glob("*llamacpp_*.json")):
        blocks.append(_llamacpp_block(path.name, json.loads(path.read_text())))
    return "\n".join(blocks)


def _quant_block(name: str, r: dict[str, Any]) -> str:
    sides = [(k, label) for k, label in QUANT_SIDES if f"{k}_ms" in r["decode"][0]]
    lines = [
        f"**{r.get('isa', '?')}, {r.get('dtype', '?')}** ([`{name}`](bench/{name}); "
        f"{_host_line(r.get('host'))}, {r.get('threads', '?')} threads"
        f"{_env_note(r.get('env'))}):\n",
        "| | " + " | ".join(label for _, label in sides) + " |",
        "|---|" + "---:|" * len(sides),
    ]
    for row in r["prefill"]:
        cells = [f"{row[f'{k}_tok_s']:,.0f} tok/s" for k, _ in sides]
        lines.append(f"| prefill {row['tokens']:,} tokens | " + " | ".join(cells) + " |")
    for row in r["decode"]:
        cells = [
            f"{row[f'{k}_ms']:.1f} ms, {row[f'{k}_read_mb']:.0f} MB "
            f"({row[f'{k}_roofline']:.0%} of {row['host_read_gb_s']:.0f} GB/s)"
            for k, _ in sides
        ]
        lines.append(
            f"| decode batch {row['batch']}, {row['context']:,} tokens of context | "
            + " | ".join(cells) + " |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def _llamacpp_block(name: str, r: dict[str, Any]) -> str:
    med, spread = r["median"], r["spread"]

    def cell(key: str) -> str:
        low, high = spread[key]
        return f"{med[key]:.1f} ms ({low:.1f}-{high:.1f})"

    modes = [k.split("_")[1] for k in med if k.startswith("ours_") and k.endswith("_decode_ms")]
    lines = [
        f"Against llama.cpp on the same GGUF ([`{name}`](bench/{name}); "
        f"`benchmarks/llamacpp_decode.py`: llama-server from the xllamacpp wheel, one slot, "
        f"{r['threads']} threads, its own timings; ours in-process, {r.get('dtype', '?')}; "
        f"{r['context']:,} random prompt tokens, then {r['steps']} greedy tokens; median of "
        f"{r['rounds']} rounds, range in brackets; {_host_line(r.get('host'))}):\n",
        "| | llama.cpp | " + " | ".join(f"radixlm {m}" for m in modes) + " |",
        "|---|---:|" + "---:|" * len(modes),
        "| decode, per token | " + cell("llamacpp_decode_ms") + " | "
        + " | ".join(f"{cell(f'ours_{m}_decode_ms')} ({r['ours_vs_llamacpp_decode'][m]:.2f}x)"
                     for m in modes) + " |",
        "| prefill of the prompt | " + cell("llamacpp_prefill_ms") + " | "
        + " | ".join(cell(f"ours_{m}_prefill_ms") for m in modes) + " |",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def agents_section() -> str:
    result = _recorded("agent_tools.json")
    if result is None:
        return _not_run("benchmarks/agent_tools.py")
    lines = [
        f"`{result['command']}` ([agents.md](agents.md)): {result['agents']} agents x "
        f"{result['steps']} steps through `radixlm serve` ({result['model']}), each step "
        "resending the whole conversation with its tools, tool choice forced. Per step: mean "
        "prompt and cached tokens, the lowest cached share of any agent, and the tokens "
        "recomputed that an earlier step had already computed.\n",
    ]
    for run in result["runs"]:
        lines += [
            f"Tools {run['tools']}:\n",
            "| step | prompt tokens | cached tokens | lowest cached share | recomputed |",
            "|---:|---:|---:|---:|---:|",
        ]
        for step in run["steps"]:
            lines.append(
                f"| {step['step']} | {step['prompt_tokens_mean']:,.0f} "
                f"| {step['cached_tokens_mean']:,.0f} | {step['cached_ratio_min']:.3f} "
                f"| {step['recomputed_total']} |"
            )
        lines.append("")
    grammar = result.get("grammar_overhead")
    if grammar:
        lines.append(
            f"Constrained decoding (`{grammar['command']}`): a decode step of {grammar['batch']} "
            f"JSON-Schema requests, median {grammar['constrained']['median_ms']:.0f} ms against "
            f"{grammar['unconstrained']['median_ms']:.0f} ms unconstrained "
            f"({grammar['slowdown']:+.1%}).\n"
        )
    lines.append(f"{_host_line(result.get('host'))}. {result.get('note', '')}\n")
    return "\n".join(lines)


def tiers_section() -> str:
    result = _recorded("cache_tiers.json")
    if result is None:
        return _not_run("benchmarks/cache_tiers.py")
    lines = [
        f"`python benchmarks/cache_tiers.py --trace TRACE` replays the Mooncake conversation "
        f"trace ({result['requests']:,} requests) through the tree, {result['inflight']} in "
        f"flight; hit rates over the last {1 - result['eval_from']:.0%} of it (the policies "
        "were tuned on the part before), against Belady's clairvoyant eviction at the same "
        "capacity ([cache.md](cache.md)):\n",
        "| eviction | RAM (L1) tokens | disk (L2) tokens | token hit rate | from L1 / from L2 "
        "| Belady (L1 only) | LRU→Belady gap closed | L2 written / read |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        l2 = r.get("l2_capacity_tokens")
        l2_hit = r.get("eval_l2_hit_rate")
        written, read = r.get("l2_bytes_written"), r.get("l2_bytes_read")
        lines.append(
            f"| {r['eviction']} | {r['capacity_tokens']:,} | {_opt(l2, '{:,}')} "
            f"| {r['eval_token_hit_rate']:.1%} "
            f"| {r['eval_l1_hit_rate']:.1%} / {_opt(l2_hit, '{:.1%}')} "
            f"| {_opt(r.get('belady_l1_hit_rate'), '{:.1%}')} "
            f"| {_opt(r.get('gap_closed'), '{:.1%}')} "
            f"| {_tb(written)} / {_tb(read)} |"
        )
    lines.append(f"\n{_host_line(result.get('host'))}.\n")
    return "\n".join(lines)


def traces_section() -> str:
    result = _recorded("cache_traces.json")
    if result is None:
        return _not_run("benchmarks/cache_traces.py")
    traces = result["traces"]
    lines = [
        f"`{result['command']}` replays the Mooncake trace (where the policies' constants were "
        "tuned) and synthetic traces of other shapes (`radixlm/bench/trace_shapes.py`, which "
        f"tuned nothing), {result['inflight']} requests in flight, hit rates over the last "
        f"{1 - result['eval_from']:.0%} of each. RAM and disk sizes per trace; in brackets the "
        "share of the LRU → Belady gap a policy closes; *same bytes*: LRU with RAM of RAM + "
        "disk; the disk tier under its three write rules (`bench/l2_sim.py`), and the KV bytes "
        "each writes per byte it reads back ([cache.md](cache.md)):\n",
        "| trace | RAM / disk tokens | LRU | turn-credit | gdsf | adaptive | Belady "
        "| same bytes | RAM + disk: filter / pressure / all | bytes written per byte read |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in traces:
        runs, gap, tiered = t["runs"], t["gap_closed"], t["tiered"]
        cells = [f"{runs['lru']:.1%}"]
        for p in ("turn-credit", "gdsf", "adaptive"):
            closed = gap.get(p)
            cells.append(f"{runs[p]:.1%}" + ("" if closed is None else f" ({closed:+.0%})"))
        rules = " / ".join(f"{tiered[r]['hit_rate']:.1%}" for r in RULES)
        name = t["name"] + (" (tuned on)" if t["tuned_on"] else "")
        lines.append(
            f"| {name} | {_short(t['ram'])} / {_short(t['disk'])} | {' | '.join(cells)} "
            f"| {runs['belady']:.1%} | {runs['lru_ram_and_disk']:.1%} | {rules} "
            f"| {' / '.join(_opt(tiered[r]['written_per_read'], '{:.1f}') for r in RULES)} |"
        )
    held_out = [t["gap_closed"]["adaptive"] for t in traces if not t["tuned_on"]]
    closed = [g for g in held_out if g is not None]
    worst = min(t["tiered"]["pressure"]["hit_rate"] - t["runs"]["lru_ram_and_disk"]
                for t in traces)  # fmt: skip
    lines.append(
        f"\nadaptive closes {statistics.mean(closed):.0%} of the LRU → Belady gap on average "
        f"over the {len(closed)} traces it was not tuned on that have a gap; RAM + disk "
        f"(pressure) is at worst {worst * 100:+.1f} points from the same bytes in RAM. "
        f"{_host_line(result.get('host'))}.\n"
    )
    return "\n".join(lines)


RULES = ("filter", "pressure", "all")  # the L2 write rules of bench/l2_sim.py


def _short(tokens: int) -> str:
    return f"{tokens / 1e6:g}M" if tokens >= 1_000_000 else f"{tokens / 1e3:g}k"


def l2_served_section() -> str:
    result = _recorded("l2_served.json")
    if result is None:
        return _not_run("benchmarks/l2_served.py")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from l2_served import render_section  # benchmarks/l2_served.py renders its own section

    return render_section(result, _host_line(result.get("host")))


def _tb(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e12:.2f} TB"


def replicas_section() -> str:
    result = _recorded("replicas.json")
    if result is None:
        return _not_run("benchmarks/replicas.py")
    config = result["config"]
    lines = [
        f"`benchmarks/replicas.py` ([replicas.md](replicas.md)): {config['groups']} prefix groups "
        f"x {config['per_group']} chat requests, ~{config['system_len']:,}-token system prompt "
        f"per group, interleaved, 4 in flight; two replicas of 1 thread and "
        f"{config['num_slots']:,} slots behind smg, or one pooled replica of 2 threads with the "
        "same slots in all; caches flushed between runs. smg flags: "
        f"`{' '.join(config.get('smg_arg') or []) or 'defaults'}`.\n",
        "| run | requests ok | hit rate | prefill computed (ideal) | least affine group "
        "| share per replica | failed |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, run in result["runs"].items():
        s = run["summary"]
        prefill = s.get("server_prefill_tokens")
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(s.get("worker_share", {}).items()))
        lines.append(
            f"| {name} | {s['num_ok']} / {s['num_requests']} | {s['hit_rate']:.1%} "
            f"| {_opt(prefill, '{:,}')} ({s['ideal_prefill_tokens']:,}) "
            f"| {_opt(s.get('min_group_affinity'), '{:.0%}')} | {shares} "
            f"| {s['num_errors']} |"
        )
    lines.append(f"\n{_host_line(result.get('host'))}.\n")
    return "\n".join(lines)


def observatory_section() -> str:
    result = _recorded("observatory_overhead.json")
    if result is None:
        return _not_run("benchmarks/observatory_overhead.py")
    lines = [
        f"`{result['command']}` ([observatory.md](observatory.md)): `radixlm serve` "
        f"({result['model']}) with every request asking for a cache report against none, chat "
        f"prompts streamed, {result['concurrency']} in flight, {result['rounds']} rounds of "
        "interleaved runs, the cache flushed before each. Output tok/s and the server's CPU "
        "seconds per run, on / off paired per round: the median, with a ~95 % interval of "
        "that median.\n",
        "| workload | off, tok/s | on, tok/s | tok/s on / off | interval | CPU on / off "
        "| interval |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, w in result["workloads"].items():
        lines.append(
            f"| {name} | {w['off_tok_s_median']:.1f} | {w['on_tok_s_median']:.1f} "
            f"| {w['ratio_median']:.3f} | {w['ratio_low']:.3f}-{w['ratio_high']:.3f} "
            f"| {w['cpu_ratio_median']:.3f} | {w['cpu_ratio_low']:.3f}-{w['cpu_ratio_high']:.3f} |"
        )
    c = result["components"]
    report = (
        f"one report's work {c['report_ms']:.2f} ms ({c['report_prompt_len']} tokens); "
        if "report_ms" in c
        else ""
    )
    lines.append(
        f"\nIn process: {report}the salt index's record, which every request pays, "
        f"{c['record_us']:.0f} µs for {c['prompt_len']:,} tokens, and a report's lookup "
        f"{c['others_us']:.0f} µs. {_host_line(result.get('host'))}. {result.get('note', '')}\n"
    )
    return "\n".join(lines)


def sglang_section() -> str:
    path = BENCH / "cache_vs_sglang.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [
        "`benchmarks/cache_compare.py` replays SGLang's own synthetic traces and the Mooncake "
        "conversation trace through both trees in one process (tree time only: match + insert "
        '+ evict + lock, 16 requests in flight); "SGLang driver" runs our tree behind SGLang\'s '
        "driver and adapter interface, the stricter comparison:\n",
        "| case | radixlm req/s | radixlm, SGLang driver | SGLang | speedup | hit rate "
        "(radixlm / SGLang) | evict p50 µs (radixlm / SGLang) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours, driven, theirs = (
            r["radixlm_requests_per_s"],
            r["radixlm_sglang_driver_requests_per_s"],
            r["sglang_requests_per_s"],
        )
        evict = "–"
        if r.get("radixlm_evict_p50_us") is not None:
            evict = f"{r['radixlm_evict_p50_us']:.1f} / {r['sglang_evict_p50_us']:.1f}"
        lines.append(
            f"| {r['case']} | {ours:,.0f} | {driven:,.0f} | {theirs:,.0f} "
            f"| {ours / theirs:.2f}x / {driven / theirs:.2f}x "
            f"| {r['radixlm_hit_rate']:.4f} / {r['sglang_hit_rate']:.4f} | {evict} |"
        )
    hosts = {_host_line(r.get("host")) for r in rows}
    impl = {r.get("sglang_impl", "?") for r in rows}
    lines.append(f"\nSGLang: {', '.join(sorted(impl))}; {'; '.join(sorted(hosts))}.\n")
    return "\n".join(lines)


# ---- formatting -------------------------------------------------------------------------------
def _recorded(name: str) -> dict[str, Any] | None:
    """docs/bench/`name`'s JSON, or None before its benchmark has run."""
    path = BENCH / name
    return json.loads(path.read_text()) if path.exists() else None


def _not_run(command: str) -> str:
    return f"No run recorded yet (`{command}`).\n"


def _host_line(host: dict[str, Any] | None) -> str:
    label = cpu_label(host)
    if host and host.get("commit"):
        label += f", at commit {host['commit']}"
    if host and host.get("recorded"):
        label += f" ({host['recorded']})"
    return label


def _env_note(env: dict[str, str] | None) -> str:
    """The variables that capped PyTorch's own instruction set for the run, if any."""
    caps = {k: v for k, v in (env or {}).items() if k != "RADIXLM_ISA"}
    return "; " + " ".join(f"`{k}={v}`" for k, v in caps.items()) if caps else ""


def _tok(run: dict[str, Any] | None) -> str:
    return "–" if run is None else f"{run['summary']['output_tok_s']:.1f}"


def _versus(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    if theirs is None:
        return "–"
    value = theirs["summary"]["output_tok_s"]
    if ours is None:
        return f"{value:.1f}"
    return f"{value:.1f} ({ours['summary']['output_tok_s'] / value:.2f}x)"


def _s(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms < 10_000 else f"{ms / 1000:.1f} s"


def _opt(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


if __name__ == "__main__":
    raise SystemExit(main())
