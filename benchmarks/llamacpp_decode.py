"""Decode and prefill speed against llama.cpp on the same GGUF file, same threads, one run.

    python -m venv xv && xv/bin/pip install xllamacpp     # build-free llama.cpp, its own venv
    .venv/bin/python benchmarks/llamacpp_decode.py --xllamacpp-python xv/bin/python \
        [--model FILE.gguf] [--context 1024] [--steps 32] [--rounds 3] [--dtype auto] \
        --json OUT.json

llama.cpp runs as its own server (llama-server from the `xllamacpp` wheel, started here with
one slot and `--threads` threads); each round sends a prompt of `context` random token ids and
asks for `steps` greedy tokens, and reads llama.cpp's own timings (prompt_ms, predicted_ms: the
server's clock, no HTTP in them). Ours runs the same shapes in this process between its rounds
(bench model's decode timer: a context of the same length cached, then `steps` decode steps;
and one prefill of `context` tokens), once per quantized numerics, in `--dtype` (auto: what
`radixlm serve` loads on this CPU). Medians over the rounds, and the spread, go to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np
import torch

from radixlm.bench.host import describe_host
from radixlm.bench.model_speed import _decode_timer, _prefill_timer
from radixlm.model import native
from radixlm.model.backend import default_dtype
from radixlm.model.loader import default_model_path, load_causal_lm

LAUNCHER = """
import sys, time
import xllamacpp as xlc
params = xlc.CommonParams()
params.model.path = sys.argv[1]
params.port = int(sys.argv[2])
params.n_parallel = 1
params.n_ctx = int(sys.argv[4])
params.cpuparams.n_threads = int(sys.argv[3])
params.cpuparams_batch.n_threads = int(sys.argv[3])
params.cache_prompt = False
server = xlc.Server(params)
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--xllamacpp-python", required=True, help="a python with xllamacpp")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quant", default="exact,fast")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    dtype = default_dtype("cpu") if args.dtype == "auto" else args.dtype
    ours = {mode: load_causal_lm(path, dtype, quant=mode) for mode in args.quant.split(",")}
    vocab = next(iter(ours.values())).config.vocab_size
    ids = np.random.default_rng(0).integers(1000, min(vocab, 40000), args.context).tolist()
    server, port = _start_llamacpp(args.xllamacpp_python, path, args.threads, args.context)
    samples: dict[str, list[float]] = {}
    try:
        timers = {}
        for mode, model in ours.items():
            timers[f"ours_{mode}_decode_ms"] = _decode_timer(
                model, ids, 1, args.steps, args.rounds + 1
            )
            timers[f"ours_{mode}_prefill_ms"] = _prefill_timer(model, "ours", args.context)
        with torch.inference_mode():
            for timer in timers.values():
                timer()  # warm-up
            _llamacpp_round(port, ids, args.steps)
            for _ in range(args.rounds):
                prompt_ms, decode_ms = _llamacpp_round(port, ids, args.steps)
                samples.setdefault("llamacpp_decode_ms", []).append(decode_ms)
                samples.setdefault("llamacpp_prefill_ms", []).append(prompt_ms)
                for name, timer in timers.items():
                    seconds = timer()
                    per = args.steps if name.endswith("decode_ms") else 1
                    samples.setdefault(name, []).append(seconds * 1e3 / per)
    finally:
        server.kill()
    result: dict[str, Any] = {
        "model": os.path.basename(path), "dtype": dtype, "threads": args.threads,
        "context": args.context,
        "steps": args.steps, "rounds": args.rounds, "isa": _isa(), "host": describe_host(),
        "median": {k: statistics.median(v) for k, v in samples.items()},
        "spread": {k: [min(v), max(v)] for k, v in samples.items()},
    }  # fmt: skip
    llama = result["median"]["llamacpp_decode_ms"]
    result["ours_vs_llamacpp_decode"] = {
        mode: llama / result["median"][f"ours_{mode}_decode_ms"] for mode in ours
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _isa() -> str | None:
    kernels = native.kernels()
    return None if kernels is None else kernels.isa


def _start_llamacpp(python: str, path: str, threads: int, context: int
                    ) -> tuple[subprocess.Popen[bytes], int]:  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as launcher:
        launcher.write(LAUNCHER)
    n_ctx = str(context + 512)
    server = subprocess.Popen([python, launcher.name, path, str(port), str(threads), n_ctx])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server, port
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("llama-server did not start")


def _llamacpp_round(port: int, ids: list[int], steps: int) -> tuple[float, float]:
    """(prompt ms, ms per generated token) by llama.cpp's own timings."""
    body = {
        "prompt": ids, "n_predict": steps, "temperature": 0.0, "ignore_eos": True,
        "cache_prompt": False,
    }  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as response:
        timings = json.load(response)["timings"]
    return float(timings["prompt_ms"]), float(timings["predicted_per_token_ms"])


if __name__ == "__main__":
    sys.exit(main())
