"""`radixlm bench model`: prefill and decode speed of the decoder, side by side with transformers.

Both run the same weights in one process with the same torch threads, in alternating rounds
(ours, theirs, ours, theirs, ...) keeping each side's best, so a noisy neighbour on a shared
machine hurts both sides alike and rarely decides the ratio.
  prefill   one request of N tokens from an empty cache: tokens/s. transformers: one forward
            with a fresh cache and `logits_to_keep=1` (what `generate` does with a prompt).
  decode    B requests, each with a C-token context already cached, greedy: ms per step, our
            ForwardBatch.build and argmax included. transformers: `generate` continuing a
            DynamicCache that holds the same context, (time(1 + S tokens) - time(1 token)) / S.
  bandwidth bytes a decode step must read (every weight once, as each side holds it: float,
            or quantized blocks + the K/V of B x C tokens) / step time, next to this host's
            read bandwidth (a large sum timed in the same rounds): the roofline fraction.
  kv dtype  ours' pools hold K/V in --kv-dtype (default: the model's dtype; int8: codes and a
            scale per row, cache/kv_quant.py); transformers keeps its own cache.
  quant     a GGUF's quantized weights run as integer blocks: ours = --quant's first mode
            (exact), then ours_fast / ours_float for the others listed.
  pytorch   ours with the native kernels off (as RADIXLM_NATIVE=0 runs): PyTorch ops + oneDNN.
  roofline  each prefill row's GFLOP/s per side (roofline.prefill_flops / time) next to this
            host's matmul peak, a large F.linear timed in the same rounds (same threads, dtype
            and ISA caps): the fraction of the peak each side reaches, and so how far ahead of
            transformers any engine could get on this CPU.
The JSON names the kernel variant that ran (`kernels.isa`; force one with RADIXLM_ISA) and the
CPU (model name and ISA flags); each row carries ours' speedup over the other sides.
`--profile` prints a torch.profiler table of one prefill and one decode step of ours.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixlm.bench import roofline
from radixlm.bench.host import describe_host
from radixlm.cache.kv_pool import KVPool, slot_bytes
from radixlm.model import native, native_build
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import DTYPES, default_model_path, load_causal_lm
from radixlm.model.transformer import CausalLM

Timer = Callable[[], float]  # runs once, returns seconds
# environment variables that choose the paths measured (recorded in the JSON when set)
ENV_KEYS = (
    "RADIXLM_ISA",
    "RADIXLM_NATIVE",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument(
        "--kv-dtype", default=None, choices=[*DTYPES, "int8"],
        help="ours' KV pool (default: --dtype); int8: codes with a bfloat16 scale per row",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="default: the cores available")
    parser.add_argument("--prefill-lens", default="128,1024,4096")
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; best kept")
    parser.add_argument("--no-transformers", action="store_true", help="ours only")
    parser.add_argument("--no-pytorch", action="store_true", help="skip ours without kernels")
    parser.add_argument("--dense", action="store_true", help="also ours with unpacked weights")
    parser.add_argument(
        "--quant", default="exact,fast,float",
        help="quantized weights: ours in each of these modes (the first is `ours`)",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="profile one prefill and decode")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    path = args.model or default_model_path()
    modes = args.quant.split(",")
    sides: dict[str, Any] = {"ours": load_causal_lm(path, args.dtype, quant=modes[0])}
    if _has_blocks(sides["ours"]):  # the other numerics are other sides
        for mode in modes[1:]:
            sides[f"ours_{mode}"] = load_causal_lm(path, args.dtype, quant=mode)
    results_quant = modes[0] if _has_blocks(sides["ours"]) else "float"
    if not args.no_pytorch:
        sides["pytorch"] = _load_without_kernels(path, args.dtype)
    if args.dense:
        sides["ours_dense"] = load_causal_lm(path, args.dtype, pack_weights=False)
    if not args.no_transformers:
        sides["transformers"] = _load_transformers(path, args.dtype)
    # the file's name, not where it lies on this machine: the JSON is committed and compared
    model = args.model or "default (SmolLM2-135M-Instruct Q4_1)"
    results: dict[str, Any] = {"model": model, "dtype": args.dtype, "threads": threads}
    results["kv_dtype"] = args.kv_dtype or args.dtype
    results["quant"] = results_quant
    results.update(_setup())
    results.update(torch=torch.__version__, prefill=[], decode=[])
    print(
        f"model {path}  dtype {args.dtype}  kv {results['kv_dtype']}  threads {threads}  "
        f"rounds {args.rounds}"
    )
    print(f"kernels {results['kernels']}  cpu {results['cpu']['model']}")
    results["matmul_peak"] = f"F.linear {roofline.PEAK_SIZE}^3, {args.dtype}, {threads} threads"
    with torch.inference_mode():
        for n in (int(x) for x in args.prefill_lens.split(",")):
            row = _prefill_row(sides, n, args)
            results["prefill"].append(row)
            _print_row("prefill", row)
        for b in (int(x) for x in args.decode_batches.split(",")):
            row = _decode_row(sides, b, args)
            _add_speedups(row, "ms", higher_is_better=False)
            results["decode"].append(row)
            _print_row("decode", row)
        if args.profile:
            _profile(sides["ours"], args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _setup() -> dict[str, Any]:
    """Which kernels ran and on what: the variant, the CPU's model name and vector ISA flags,
    the environment variables that pick paths, and the commit."""
    kernels = native.kernels()
    ran = None if kernels is None else {"isa": kernels.isa, "bf16_dots": kernels.bf16_dots}
    flags = native_build.cpu_flags()
    isa_flags = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "isa": None if kernels is None else kernels.isa,  # as docs/bench/model_speed.json has it
        "kernels": ran,
        "cpu": {"model": native_build.cpu_name(), "isa_flags": isa_flags},
        "host": describe_host(),  # the other benches' host record (docs/benchmarks.md reads it)
        "env": env,
        "commit": commit or None,
    }


def _add_speedups(row: dict[str, Any], unit: str, higher_is_better: bool) -> None:
    """row["ours_vs_<side>"]: how many times faster ours ran than each other side."""
    ours = row[f"ours_{unit}"]
    for key in [k for k in row if k.endswith(f"_{unit}") and k != f"ours_{unit}"]:
        other = row[key]
        side = key[: -len(unit) - 1]
        row[f"ours_vs_{side}"] = ours / other if higher_is_better else other / ours


def _load_without_kernels(path: str, dtype: str) -> CausalLM:
    """Ours as RADIXLM_NATIVE=0 loads and runs it: oneDNN-packed weights, PyTorch ops."""
    before = os.environ.get("RADIXLM_NATIVE")
    os.environ["RADIXLM_NATIVE"] = "0"
    try:
        model = load_causal_lm(path, dtype)
    finally:
        if before is None:
            del os.environ["RADIXLM_NATIVE"]
        else:
            os.environ["RADIXLM_NATIVE"] = before
    model.use_kernels(None)
    return model


def _alternate(timers: dict[str, Timer], rounds: int) -> dict[str, float]:
    """Best seconds of each timer over `rounds` alternating rounds, after one warm-up each."""
    for timer in timers.values():
        timer()
    best = {name: float("inf") for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = min(best[name], timer())
    return best


def _prefill_timer(model: Any, side: str, n: int, kv_dtype: str | None = None) -> Timer:
    ids = _token_ids(n, _vocab_size(model))
    if side == "transformers":
        input_ids = torch.tensor([ids])
        return _timed(lambda: model(input_ids, use_cache=True, logits_to_keep=1))
    pool = _pool(model, n, kv_dtype)
    slots, empty = pool.alloc(n), np.zeros(0, dtype=np.int64)
    return _timed(lambda: model(ForwardBatch.build([ids], [empty], [slots]), pool))


def _prefill_row(sides: dict[str, Any], n: int, args: argparse.Namespace) -> dict:
    """One prefill of n tokens per side, and the matmul peak, in the same alternating rounds."""
    timers = {name: _prefill_timer(model, name, n, args.kv_dtype) for name, model in sides.items()}
    timers["matmul_peak"] = roofline.matmul_peak_timer(DTYPES[args.dtype])
    best = _alternate(timers, args.rounds if n <= 1024 else max(1, args.rounds - 1))
    peak_s = best.pop("matmul_peak")
    row: dict[str, Any] = {"tokens": n, **{f"{name}_tok_s": n / t for name, t in best.items()}}
    _add_speedups(row, "tok_s", higher_is_better=True)
    flops = roofline.prefill_flops(sides["ours"].config, n)
    row["gflop"] = flops.total / 1e9
    row.update({f"{name}_gflop_s": flops.total / t / 1e9 for name, t in best.items()})
    row["matmul_peak_gflop_s"] = roofline.PEAK_FLOPS / peak_s / 1e9
    return row


def _decode_row(sides: dict[str, Any], batch_size: int, args: argparse.Namespace) -> dict:
    context = _token_ids(args.context, _vocab_size(sides["ours"]))
    timers: dict[str, Timer] = {}
    for name, model in sides.items():
        if name == "transformers":
            one, many = _generate_timers(model, context, batch_size, args.steps)
            timers.update({"transformers_1": one, "transformers_n": many})
        else:
            rounds = args.rounds + 1
            timers[name] = _decode_timer(
                model, context, batch_size, args.steps, rounds, args.kv_dtype
            )
    read_timer, read_bytes = roofline.read_bandwidth_timer()
    timers["read_bandwidth"] = read_timer
    best = _alternate(timers, args.rounds)
    row: dict[str, Any] = {"batch": batch_size, "context": args.context}
    row["host_read_gb_s"] = read_bytes / best.pop("read_bandwidth") / 1e9
    float_mb = sum(_decode_bytes(sides["ours"], batch_size, args.context, blocks=False)) / 1e6
    for name in sides:
        if name == "transformers":
            ms = (best["transformers_n"] - best["transformers_1"]) / args.steps * 1e3
            mb = float_mb  # transformers dequantizes a GGUF to float
        else:
            ms = best[name] / args.steps * 1e3
            kv_dtype = args.kv_dtype
            mb = sum(_decode_bytes(sides[name], batch_size, args.context, kv_dtype=kv_dtype)) / 1e6
        row[f"{name}_ms"] = ms
        row[f"{name}_read_mb"] = mb
        row[f"{name}_gb_s"] = mb / ms
        row[f"{name}_roofline"] = row[f"{name}_gb_s"] / row["host_read_gb_s"]
    return row


def _decode_timer(
    model: CausalLM,
    context: list[int],
    batch_size: int,
    steps: int,
    rounds: int,
    kv_dtype: str | None = None,
) -> Timer:
    """Each call: `steps` greedy decode steps of `batch_size` requests sharing no slots."""
    n = len(context)
    pool = _pool(model, batch_size * (n + steps * (rounds + 1)), kv_dtype)
    first = pool.alloc(n)
    model(ForwardBatch.build([context], [np.zeros(0, dtype=np.int64)], [first]), pool)
    seqs = [first] + [pool.alloc(n) for _ in range(batch_size - 1)]
    for slots in seqs[1:]:  # the same context, copied into each request's own slots
        pool.copy_slots(slots, first)
    tokens = [[context[-1]]] * batch_size

    def decode_steps() -> float:
        nonlocal seqs, tokens
        start = time.perf_counter()
        for _ in range(steps):
            new = [pool.alloc(1) for _ in range(batch_size)]
            batch = ForwardBatch.build(tokens, seqs, new)
            tokens = [[t] for t in model(batch, pool).argmax(-1).tolist()]
            seqs = [np.concatenate([s, x]) for s, x in zip(seqs, new)]
        return time.perf_counter() - start

    return decode_steps


def _generate_timers(
    model: Any, context: list[int], batch_size: int, steps: int
) -> tuple[Timer, Timer]:
    ids = torch.tensor([context])
    base = model(ids, use_cache=True, logits_to_keep=1).past_key_values
    prompt = ids.repeat(batch_size, 1)
    prompt = torch.cat([prompt, prompt[:, -1:]], dim=1)  # the new token, after the cached C

    def generate(new_tokens: int) -> float:
        cache = copy.deepcopy(base)
        cache.batch_repeat_interleave(batch_size)
        start = time.perf_counter()
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        return time.perf_counter() - start

    return (lambda: generate(1)), (lambda: generate(steps + 1))


def _has_blocks(model: CausalLM) -> bool:
    return any(getattr(m, "quant", None) is not None for m in model.modules())


def _decode_bytes(
    model: CausalLM,
    batch_size: int,
    context: int,
    blocks: bool = True,
    kv_dtype: str | None = None,
) -> tuple[int, int]:
    """(K/V bytes, weight bytes) one decode step reads: every weight once (as the model holds
    it: float, or quantized records; with `blocks` False, as float32 or the model's dtype),
    K/V of B x C tokens in `kv_dtype` (default: the model's; int8 with its scales). The input
    embedding is only indexed (B rows); a tied lm_head still reads all of it."""
    c = model.config
    weight = model.model.embed_tokens.weight
    element = weight.element_size()
    pool_dtype = _KV_DTYPES[kv_dtype] if kv_dtype else weight.dtype
    token = slot_bytes(c.num_layers, c.num_kv_heads, c.head_dim, pool_dtype)
    kv = batch_size * (context + 1) * token
    weights = 0
    for name, module in model.named_modules():
        if name == "model.embed_tokens":
            continue
        quant = getattr(module, "quant", None)
        for pname, p in module.named_parameters(recurse=False):
            if quant is not None and pname == "weight":
                rows, cols = quant.out_features, quant.in_features
                weights += quant.nbytes if blocks else rows * cols * element
            else:
                weights += p.numel() * element
    return kv, weights


def _profile(model: CausalLM, context: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    prefill = _prefill_timer(model, "ours", 1024)
    prefill()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prefill()
    print("\n== profile: ours, one prefill of 1024 tokens ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    decode = _decode_timer(model, _token_ids(context, model.config.vocab_size), 8, 1, 2)
    decode()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode()
    print(f"\n== profile: ours, one decode step, batch 8, context {context} ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def _load_transformers(path: str, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype], "local_files_only": True}
    if path.endswith(".gguf"):
        path, kwargs["gguf_file"] = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.generation_config.eos_token_id = None  # never stop early
    return model.eval()


def _timed(call: Callable[[], Any]) -> Timer:
    def timer() -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return timer


def _pool(model: CausalLM, num_slots: int, kv_dtype: str | None = None) -> KVPool:
    """A pool for `model` in `kv_dtype` (default: the model's dtype)."""
    c, weight = model.config, model.model.embed_tokens.weight
    dtype = _KV_DTYPES[kv_dtype] if kv_dtype else weight.dtype
    return KVPool(num_slots, c.num_layers, c.num_kv_heads, c.head_dim, dtype)


_KV_DTYPES = {**DTYPES, "int8": torch.int8}  # --kv-dtype's choices


def _vocab_size(model: Any) -> int:
    return int(model.config.vocab_size)


def _token_ids(n: int, vocab_size: int) -> list[int]:
    return np.random.default_rng(n).integers(0, vocab_size, n).tolist()


def _print_row(kind: str, row: dict[str, Any]) -> None:
    cells = (f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(kind, " ".join(cells), flush=True)
