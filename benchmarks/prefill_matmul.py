"""Prefill matmuls of SmolLM2-135M, in GFLOP/s: our skinny_linear tiles (one line per kernel
variant this CPU executes) against oneDNN on packed weights and F.linear (MKL), float32.

Every side runs in the same process, in rounds that alternate the sides (each round starts at
a different side), and the figure is the median of the rounds: on a shared host a single timing
is noise. PyTorch's instruction set is fixed when it starts, so cap it from the environment to
compare at AVX2:

    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        .venv/bin/python benchmarks/prefill_matmul.py --threads 2

`--lib PATH` adds a library with the same `skinny_linear` entry point (a kernel under trial).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from radixlm.model import native, native_build, packed_linear

# (name, K, N) of SmolLM2-135M's layer matmuls: y (M, N) = x (M, K) W^T
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
ROWS = [128, 512, 1024]
Trial = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (x, packed W, threads) -> y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--min-ms", type=float, default=30.0, help="time per side per round")
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--lib", action="append", default=[], help="a trial skinny_linear .so")
    parser.add_argument("--no-torch", action="store_true", help="only the native kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {
        v.name: kernels_
        for v in native_build.executable_variants()
        if (kernels_ := native.kernels_for(v.name)) is not None
    }
    trials = {os.path.basename(p): _raw_skinny(p) for p in args.lib}
    load = os.getloadavg()[0]
    caps = {
        k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ
    }
    print(f"threads {args.threads}, rounds {args.rounds}, load {load:.2f}, caps {caps or 'none'}")
    for name, k, n in SHAPES:
        if name not in args.shapes:
            continue
        w = torch.randn(n, k) / k**0.5
        for m in args.rows:
            x = torch.randn(m, k)
            sides = _sides(kernels, trials, x, w, args.threads, torch_sides=not args.no_torch)
            ref = x @ w.T
            for label, fn in sides.items():
                err = (fn() - ref).abs().max().item()
                assert err < 1e-3, f"{label}: max error {err}"
            secs = _rounds(sides, args.rounds, args.min_ms)
            flop = 2.0 * m * n * k
            cells = "  ".join(f"{label} {flop / s / 1e9:6.1f}" for label, s in secs.items())
            print(f"{name:8s} K {k:5d} N {n:5d} M {m:5d}  {cells}", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


def _sides(
    kernels: dict[str, native.Kernels],
    trials: dict[str, Trial],
    x: torch.Tensor,
    w: torch.Tensor,
    threads: int,
    torch_sides: bool,
) -> dict[str, Callable[[], torch.Tensor]]:
    """The matmul x W^T as each side computes it, W packed the way that side takes it."""
    packed = native.pack_skinny(w)
    assert packed is not None
    sides: dict[str, Callable[[], torch.Tensor]] = {
        f"ours {isa}": functools.partial(kk.skinny_linear, x, packed) for isa, kk in kernels.items()
    }
    for label, fn in trials.items():
        sides[label] = functools.partial(fn, x, packed, threads)
    if torch_sides:
        onednn = packed_linear.pack_weight(w)
        sides["oneDNN packed"] = lambda: packed_linear.linear(x, onednn, None)
        sides["F.linear"] = lambda: torch.nn.functional.linear(x, w)
    return sides


def _rounds(
    sides: dict[str, Callable[[], torch.Tensor]], rounds: int, min_ms: float
) -> dict[str, float]:
    """Median seconds per call of each side, over `rounds` alternating rounds."""
    reps = {}
    for label, fn in sides.items():  # warm up, and size each side's round to about min_ms
        fn()
        start = time.perf_counter()
        fn()
        reps[label] = max(1, int(min_ms / 1e3 / (time.perf_counter() - start)))
    times: dict[str, list[float]] = {label: [] for label in sides}
    labels = list(sides)
    for r in range(rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            fn = sides[label]
            start = time.perf_counter()
            for _ in range(reps[label]):
                fn()
            times[label].append((time.perf_counter() - start) / reps[label])
    return {label: statistics.median(t) for label, t in times.items()}


def _raw_skinny(path: str) -> Trial:
    fn = ctypes.CDLL(path).skinny_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2

    def call(x: torch.Tensor, packed: torch.Tensor, threads: int) -> torch.Tensor:
        m, k = x.shape
        n = packed.shape[0] * 16
        y = x.new_empty(m, n)
        bf16 = int(x.dtype == torch.bfloat16)
        status = fn(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, bf16, threads)
        if status:
            raise RuntimeError(f"skinny_linear status {status}")
        return y

    return call


if __name__ == "__main__":
    main()
