"""The floor: Hugging Face transformers `generate`, offline, no cache shared across requests.

    .venv/bin/python benchmarks/peers/hf_offline.py --model HF_DIR --workload gsp \\
        --param num_groups=4 ... --concurrency 8 --json OUT

The same workloads (radixlm/bench/workloads.py, same seed and token range as `bench serve`) run
as static batches: up to `concurrency` requests that are ready (their parent finished) are
left-padded into one `generate` call, greedy, exactly output_len new tokens each; the next batch
starts when it returns. TTFT is the time from a batch's start to its first sampled token (the
prefill of the whole batch); every request of a batch shares it. The JSON summary has the keys
`bench serve` writes, so the runner tabulates both alike.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from radixlm.bench.online import workload_from_args
from radixlm.bench.online_stats import percentiles
from radixlm.bench.workloads import WORKLOADS, WorkloadProgress


class _FirstTokenClock(LogitsProcessor):
    """Records when the first token's logits are ready (right after the batch's prefill)."""

    def __init__(self) -> None:
        self.first_s: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_s is None:
            self.first_s = time.perf_counter()
        return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--param", action="append", default=[], metavar="KEY=INT")
    parser.add_argument("--token-range", default="1000:30000", metavar="LO:HI")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8, help="requests per batch at most")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    workload = workload_from_args(SimpleNamespace(**vars(args)))
    _run_batch(model, [[1000 + i for i in range(32)]], 4)  # warm-up
    summary = run(model, workload, args.concurrency)
    print(json.dumps(summary, indent=2))
    if args.json:
        config = {
            "workload": workload.name,
            "params": args.param,
            "concurrency": args.concurrency,
            "num_requests": len(workload.requests),
            "torch_threads": args.threads,
        }
        with open(args.json, "w") as f:
            json.dump({"config": config, "summary": summary}, f, indent=2)


def run(model: Any, workload: Any, batch_size: int) -> dict[str, Any]:
    progress = WorkloadProgress(workload)
    ready = list(progress.roots)
    ttft: dict[int, float] = {}
    output_tokens = 0
    start = time.perf_counter()
    while ready:
        batch, ready = ready[:batch_size], ready[batch_size:]
        output_len = max(workload.requests[i].output_len for i in batch)
        prompts = [progress.prompt(i) for i in batch]
        outputs, first_s, batch_start = _run_batch(model, prompts, output_len)
        for i, out in zip(batch, outputs):
            out = out[: workload.requests[i].output_len]
            ttft[i] = first_s - batch_start
            output_tokens += len(out)
            ready += progress.finish(i, out)
    duration = time.perf_counter() - start
    summary: dict[str, Any] = {
        "num_requests": len(workload.requests),
        "num_ok": len(ttft),
        "num_errors": 0,
        "duration_s": duration,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / duration,
        "request_s": len(workload.requests) / duration,
        "prompt_tokens": sum(len(c.prompt_ids) for c in progress.completed()),
        "cached_tokens": 0,
        **percentiles("ttft", list(ttft.values())),
    }
    if any(r.parent is not None for r in workload.requests):
        for name, has_parent in (("root", False), ("followup", True)):
            values = [
                t
                for i, t in ttft.items()
                if (workload.requests[i].parent is not None) == has_parent
            ]
            summary.update(percentiles(f"{name}_ttft", values))
    return summary


@torch.inference_mode()
def _run_batch(
    model: Any, prompts: list[list[int]], output_len: int
) -> tuple[list[list[int]], float, float]:
    """Greedy `generate` of exactly output_len tokens for left-padded prompts."""
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, T)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _FirstTokenClock()
    batch_start = time.perf_counter()
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=output_len,
        min_new_tokens=output_len, do_sample=False, pad_token_id=pad,
        logits_processor=LogitsProcessorList([clock]),
    )  # fmt: skip
    new = out[:, width:].tolist()  # (B, output_len)
    assert clock.first_s is not None
    return new, clock.first_s, batch_start


if __name__ == "__main__":
    main()
