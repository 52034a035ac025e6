"""A neighbour's inter-token latency alone, and beside one request whose fields are at their
allowed maximum: no single request may stall the engine thread (docs/security.md).

    python benchmarks/neighbour_latency.py [--rounds 3] [--num-threads 1] [--json PATH]
    python benchmarks/neighbour_latency.py --serve-args "--speculate auto"  # its server's flags
    python benchmarks/neighbour_latency.py --checkout ../other-checkout   # its server instead

`radixlm serve` (the default model, float32) runs in a child process (from `--checkout`, by
default this one). The neighbour streams a greedy chat of 48 tokens; its inter-token latency
(ITL) is the time between two streamed chunks. Per scenario and round, the neighbour runs alone
and then beside a request that is started first and runs for the whole of the neighbour's run:

    plain        the control: a long greedy decode with no special field (the neighbour then
                 shares every step with a sequence thousands of tokens long)
    stops        16 stop strings filling the length bound, logit_bias +100 on the token "a":
                 the output follows the last ("aaa...b"), so the held text grows every token,
                 and every suffix of it misses the others ("abab..."): the former check's
                 worst case, O(stops x held^2) a token
    logit_bias   300 logit_bias entries (the most OpenAI allows)
    maximal      both, plus min_tokens and the most stop_token_ids
    tools_400    a tool description over the character bound (a 400 before anything reads
                 it), sent again each time the last one was answered
    tools_tokens one within the character bound but over the context once tokenized (a 400
                 after rendering and tokenizing, off the event loop), sent again likewise
    tools_prompt a tool description of ~7,000 tokens: admitted, its prompt prefilled in chunks
                 beside the neighbour (compute shared by design, not a stall: for scale)

The streaming scenarios run `--warm-s` seconds (20) before the neighbour starts, so their held
text is a thousand characters or more by then. The figures are the neighbour's median and worst
ITL beside over alone (the median over the rounds); the bound is 2. Sharing every step with any
long sequence costs the neighbour about that much on one CPU thread already, so "plain" is the
control: against it, the same ratios say what the fields themselves add. The child server's
threads are the only compute; the driver only waits on sockets.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from radixlm.bench.host import describe_host
from radixlm.bench.online_replicas import wait_until_healthy

NEIGHBOUR_TOKENS = 48
SCENARIOS = ("plain", "stops", "logit_bias", "maximal", "tools_400", "tools_tokens", "tools_prompt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--num-slots", type=int, default=16384)
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--warm-s", type=float, default=20.0)
    # Speculation off: with drafts a streamed chunk carries several tokens, and the time
    # between chunks is no longer a per-token latency (what this benchmark bounds).
    parser.add_argument("--serve-args", default="--speculate off", help="radixlm serve flags")
    args = parser.parse_args()
    limit, a_id = model_facts(args.num_slots)
    result: dict[str, Any] = {
        "command": "python benchmarks/neighbour_latency.py " + " ".join(sys.argv[1:]),
        "host": describe_host(),
        "num_threads": args.num_threads,
        "serve_args": args.serve_args,
        "max_prompt_chars": limit,
        "scenarios": {},
    }
    with Server(args.checkout, args.num_threads, args.num_slots, args.serve_args.split()) as server:
        neighbour_itl(server.base)  # warm up
        for name in args.only:
            alone = [neighbour_itl(server.base) for _ in range(args.rounds)]
            beside = [
                run_beside(server.base, name, limit, a_id, args.warm_s) for _ in range(args.rounds)
            ]
            result["scenarios"][name] = summary(alone, beside)
            print(name, json.dumps(result["scenarios"][name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def summary(alone: list[list[float]], beside: list[list[float]]) -> dict[str, Any]:
    """Per round the neighbour's median and worst ITL (ms), alone and beside; their ratios'
    medians over the rounds."""
    out: dict[str, Any] = {}
    for stat, fn in (("median", statistics.median), ("max", max)):
        a = [1000 * fn(run) for run in alone]
        b = [1000 * fn(run) for run in beside]
        out[f"alone_{stat}_itl_ms"] = [round(x, 1) for x in a]
        out[f"beside_{stat}_itl_ms"] = [round(x, 1) for x in b]
        out[f"ratio_{stat}"] = round(statistics.median(y / x for x, y in zip(a, b, strict=True)), 2)
    return out


def neighbour_itl(base: str) -> list[float]:
    """The neighbour's inter-token latencies (seconds), one streamed greedy chat."""
    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": NEIGHBOUR_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    arrivals: list[float] = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(arrivals[1:])]  # from the second token on


def run_beside(base: str, scenario: str, limit: int, a_id: int, warm_s: float) -> list[float]:
    """The neighbour's ITLs while the scenario's request runs (started, and streaming for
    `warm_s`, first)."""
    started, done = threading.Event(), threading.Event()
    args = (base, scenario, limit, a_id, started, done)
    thread = threading.Thread(target=_maximal, args=args)
    thread.start()
    started.wait(600)
    if not scenario.startswith("tools"):
        time.sleep(warm_s)
    try:
        return neighbour_itl(base)
    finally:
        done.set()
        thread.join()


def _maximal(
    base: str,
    scenario: str,
    limit: int,
    a_id: int,
    started: threading.Event,
    done: threading.Event,
) -> None:
    if scenario == "tools":  # refused at once, again and again, while the neighbour runs
        tool = {
            "type": "function",
            "function": {"name": "f", "description": "x" * (limit + 1), "parameters": {}},
        }
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 4}
        with httpx.Client(timeout=600) as client:  # fmt: skip
            while not done.is_set():
                client.post(base + "/v1/chat/completions", json=body)
                started.set()
        return
    body = maximal_body(scenario, limit, a_id)
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                started.set()
            if done.is_set():
                break  # hang up: the server aborts the request
    started.set()


def maximal_body(scenario: str, limit: int, a: int) -> dict[str, Any]:
    """A completion whose fields are at their maximum (see the module docstring); `a` is the
    model's token for "a"."""
    body: dict[str, Any] = {
        "prompt": "a a a a", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    if scenario in ("stops", "maximal"):
        each = (limit - 4000) // 16  # leave room for the prompt and the logit_bias keys
        body["stop"] = [("ab" * each)[:each]] * 15 + ["a" * (each - 1) + "b"]
        body["logit_bias"] = {str(a): 100}
    if scenario in ("logit_bias", "maximal"):
        bias = {str(1000 + i): -1.0 for i in range(299)}
        body["logit_bias"] = {**bias, **body.get("logit_bias", {str(1299): -1.0})}
    if scenario == "maximal":
        body["min_tokens"] = 3000
        body["stop_token_ids"] = list(range(2000, 2016))
    return body


def model_facts(num_slots: int) -> tuple[int, int]:
    """(the server's character bound: max_seq_len x the longest vocabulary entry, the token of
    "a") for the default model."""
    from radixlm.model.loader import default_model_path
    from radixlm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(default_model_path())
    context = 8192  # the default model's
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    return min(context, num_slots) * int(tokenizer.max_chars_per_token), int(a)


class Server:
    """`radixlm serve` from `checkout` in a child process on a free port."""

    def __init__(self, checkout: str, num_threads: int, num_slots: int, extra: list[str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.checkout, self.num_threads, self.num_slots = checkout, num_threads, num_slots
        self.extra = extra

    def __enter__(self) -> Server:
        command = [sys.executable, "-m", "radixlm", "serve", "--port", str(self.port),
                   "--dtype", "float32", "--num-threads", str(self.num_threads),
                   "--num-slots", str(self.num_slots), "--log-level", "warning",
                   *self.extra]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": self.checkout}
        self.process = subprocess.Popen(command, env=env, cwd=self.checkout)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_until_healthy(self.process, self.base, 300)
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


if __name__ == "__main__":
    main()
