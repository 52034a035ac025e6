"""The int8 KV pool against bfloat16 on the default model's shape: capacity, the scales' layout,
and decode step time.

    capacity  tokens a pool of the same bytes holds (KVPool's tensors, scales included)
    layout    one decode step's attention (30 layers, B requests of C tokens, the native
              decode kernel through its C entry point) over K/V stored as bfloat16, as int8
              with the scales in arrays of their own (KVPool's layout), or as int8 with each
              row's scale inline after its codes (rows of head_dim + 2 bytes); slots in order
              (a fresh pool) or shuffled (a pool after churn)
    decode    the default model (GGUF Q4_1, exact numerics, --dtype) decoding B requests of C
              cached tokens each, as `radixlm bench model` times it (ms a step, its argmax and
              ForwardBatch.build included), over an int8 pool and a bfloat16 one

Every part alternates its sides round by round (each round starting at a different side) and
reports, per side, the median over the rounds with the quartiles and the best, and per side
the median of its per-round ratio to bfloat16 with the ratio's quartiles: both sides of a round
run next to the same neighbours, so on a shared host the paired ratio is the steadier figure.

    nice -n 19 .venv/bin/python benchmarks/kv_int8.py --threads 2 --json docs/bench/kv_int8.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixlm.bench.host import describe_host
from radixlm.bench.model_speed import _decode_timer
from radixlm.cache.kv_pool import KVPool
from radixlm.model import native, native_build
from radixlm.model.loader import default_model_path, load_causal_lm

LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64  # SmolLM2-135M
Timer = Callable[[], float]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=8, help="decode steps per model round")
    parser.add_argument("--skip", default="", help="parts to skip: layout,decode")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.kernels()
    assert kernels is not None, "the native kernels did not build"
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {
        "cpu": native_build.cpu_name(), "isa": kernels.isa, "threads": args.threads,
        "rounds": args.rounds, "context": args.context, "host": describe_host(),
        "capacity": capacity(),
    }  # fmt: skip
    print("capacity", results["capacity"])
    if "layout" not in args.skip:
        results["layout"] = [
            layout_row(kernels, b, args.context, shuffled, args.rounds)
            for b in batches
            for shuffled in (False, True)
        ]
    if "decode" not in args.skip:
        results["decode"] = decode_rows(args, batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def capacity() -> dict[str, Any]:
    """Tokens per GiB of pool for each dtype, from the bytes its tensors really hold."""
    out: dict[str, Any] = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        pool = KVPool(4096, LAYERS, KV_HEADS, HEAD_DIM, dtype)
        tensors = [pool.k, pool.v, pool.k_scales, pool.v_scales]
        held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        assert held == pool.capacity * pool.bytes_per_slot
        out[name] = {
            "bytes_per_token": held // pool.capacity,
            "tokens_per_gib": 2**30 * 4096 // held,
        }
    out["int8_vs_bfloat16"] = out["int8"]["tokens_per_gib"] / out["bfloat16"]["tokens_per_gib"]
    return out


class Layout:
    """One way to store 30 layers of K/V for the decode kernel: per layer the K, V (and scales)
    addresses, and the strides decode_attention takes."""

    def __init__(self, kind: str, num_slots: int) -> None:
        gen = torch.Generator().manual_seed(0)
        shape = (LAYERS, KV_HEADS, num_slots)  # head-major, as KVPool on CPU
        self.kind, self.keep = kind, []
        if kind == "bfloat16":
            self.kv = [torch.randn(*shape, HEAD_DIM, generator=gen).bfloat16() for _ in range(2)]
            self.strides, self.scale_strides, self.mode = (
                (HEAD_DIM, num_slots * HEAD_DIM),
                (0, 0),
                2,
            )
            self.scales: list[torch.Tensor] | None = None
        elif kind == "int8-separate":
            self.kv = [torch.randint(-127, 128, (*shape, HEAD_DIM), dtype=torch.int8, generator=gen)
                       for _ in range(2)]  # fmt: skip
            self.scales = [torch.full(shape, 0.02).bfloat16() for _ in range(2)]
            self.strides, self.scale_strides, self.mode = (
                (HEAD_DIM, num_slots * HEAD_DIM),
                (1, num_slots),
                3,
            )
        else:  # int8-inline: rows of HEAD_DIM codes then 2 scale bytes
            row = HEAD_DIM + 2
            rows = [torch.randint(-127, 128, (*shape, row), dtype=torch.int8, generator=gen)
                    for _ in range(2)]  # fmt: skip
            for r in rows:  # a plausible bfloat16 scale in the last two bytes
                r[..., HEAD_DIM:].view(torch.bfloat16).fill_(0.02)
            self.kv, self.scales = rows, None
            self.strides, self.scale_strides, self.mode = (
                (row, num_slots * row),
                (row // 2, num_slots * row // 2),
                3,
            )

    def pointers(self, layer: int) -> tuple[int, int, int | None, int | None]:
        k, v = self.kv[0][layer].data_ptr(), self.kv[1][layer].data_ptr()
        if self.kind == "bfloat16":
            return k, v, None, None
        if self.scales is not None:
            return k, v, self.scales[0][layer].data_ptr(), self.scales[1][layer].data_ptr()
        return k, v, k + HEAD_DIM, v + HEAD_DIM  # inline: the scale follows the codes


def layout_row(
    kernels: native.Kernels, batch: int, context: int, shuffled: bool, rounds: int
) -> dict[str, Any]:
    """Decode attention over 30 layers for each layout, alternating: ms per step."""
    num_slots = batch * (context + 1)
    order = np.random.default_rng(1).permutation(num_slots) if shuffled else np.arange(num_slots)
    slot_lists = [torch.from_numpy(order[i * (context + 1) : (i + 1) * (context + 1)].copy())
                  for i in range(batch)]  # fmt: skip
    decode = native.DecodeLayout(slot_lists, [])
    units, shared, own, member_row, slots = decode.pointers
    q = torch.randn(batch, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    fn = kernels._fn["decode_attention"]
    timers: dict[str, Timer] = {}
    for kind in ("bfloat16", "int8-separate", "int8-inline"):
        lay = Layout(kind, num_slots)

        def step(lay: Layout = lay) -> float:
            start = time.perf_counter()
            for layer in range(LAYERS):
                k, v, ks, vs = lay.pointers(layer)
                fn(q=q.data_ptr(), k=k, v=v, k_scales=ks, v_scales=vs, out=out.data_ptr(),
                   num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                   slot_stride=lay.strides[0], head_stride=lay.strides[1],
                   scales_slot_stride=lay.scale_strides[0], scales_head_stride=lay.scale_strides[1],
                   kv_mode=lay.mode, scale=HEAD_DIM**-0.5, num_units=decode.num_units,
                   units=units, shared=shared, own=own, member_row=member_row, slots=slots,
                   num_threads=torch.get_num_threads())  # fmt: skip
            return time.perf_counter() - start

        timers[kind] = step
    row = {"batch": batch, "context": context, "slots": "shuffled" if shuffled else "in order"}
    row.update(alternate(timers, rounds, repeats=5, scale=1e3, base="bfloat16"))
    print("layout", row, flush=True)
    return row


def decode_rows(args: argparse.Namespace, batches: list[int]) -> list[dict[str, Any]]:
    """The default model's decode steps over an int8 and a bfloat16 pool, alternating."""
    model = load_causal_lm(default_model_path(), args.dtype, quant="exact")
    context = np.random.default_rng(args.context).integers(0, model.config.vocab_size, args.context)
    rows = []
    for batch in batches:
        timers = {
            kv: _decode_timer(model, context.tolist(), batch, args.steps, 2 * args.rounds + 2, kv)
            for kv in ("bfloat16", "int8")
        }
        row: dict[str, Any] = {"batch": batch, "context": args.context, "dtype": args.dtype}
        row.update(
            alternate(timers, args.rounds, repeats=1, scale=1e3 / args.steps, base="bfloat16")
        )
        print("decode", row, flush=True)
        rows.append(row)
    return rows


def alternate(
    timers: dict[str, Timer], rounds: int, repeats: int, scale: float, base: str
) -> dict[str, dict[str, float]]:
    """Each timer over `rounds` rounds (after a warm-up), each round the best of `repeats`
    calls, round r starting at side r mod n; seconds times `scale`: median, quartiles, best,
    and the median and quartiles of its per-round speedup over `base` (base time / its time)."""
    names = list(timers)
    for name in names:
        timers[name]()
    seen: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seen[name].append(min(timers[name]() for _ in range(repeats)) * scale)
    out = {}
    for name, times in seen.items():
        speedups = [b / t for b, t in zip(seen[base], times)]
        q1, median, q3 = statistics.quantiles(times, n=4)
        s1, s_median, s3 = statistics.quantiles(speedups, n=4)
        out[name] = {
            "median": median, "q1": q1, "q3": q3, "best": min(times),
            "speedup_median": s_median, "speedup_q1": s1, "speedup_q3": s3,
        }  # fmt: skip
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
