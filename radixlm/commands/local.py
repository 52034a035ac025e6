"""The model in this process, for the terminal commands: load it, and run one request on it.

`load_engine` shows a progress bar per loading stage (weights, tokenizer, KV pool): on a CPU the
default model takes several seconds to dequantize and its 65,536-slot pool a few GB.
`run_one` drives the synchronous engine step by step for a single request, handing each piece of
text to a callback as it is decoded; Ctrl-C aborts the request (its slots come back) and
re-raises, so `chat` can go back to its prompt.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixlm.api_types import SamplingParams
from radixlm.commands.options import EngineConfigs
from radixlm.engine.engine import Engine

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class Reply:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    finish_reason: str | None = None
    ttft_s: float = 0.0  # submit -> first token
    total_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode_s if decode_s > 0 else 0.0


def load_engine(configs: EngineConfigs) -> Engine:
    """Build the engine (load the model, allocate the pool) behind a progress bar per stage."""
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    name = configs.model.path or "SmolLM2-135M-Instruct (the default model)"
    print(f"Loading {name} on {configs.model.device}", file=sys.stderr)
    columns = (
        TextColumn("{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
    )
    with Progress(*columns, TimeElapsedColumn(), console=_stderr_console()) as bars:
        tasks: dict[str, TaskID] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total)
            bars.update(tasks[stage], completed=done, total=total)

        engine = Engine(*configs, progress=progress)
    # What loading left (the tokenizer's tables, the model's modules: ~360k objects for the
    # default model) lives as long as the process. Frozen, the collector never walks it again:
    # a full collection over it took 170 ms, a stall of every thread the GIL serves.
    gc.collect()
    gc.freeze()
    pool_gb = engine.runner.pool.bytes_per_slot * engine.cache.capacity / 1e9
    print(f"Ready: {engine.cache.capacity} KV slots ({pool_gb:.1f} GB).", file=sys.stderr)
    return engine


def run_one(
    engine: Engine,
    prompt_ids: list[int],
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
) -> Reply:
    """Run one request to completion on an idle engine; Ctrl-C aborts it and re-raises."""
    reply = Reply(prompt_tokens=len(prompt_ids))
    start = time.perf_counter()
    rid = engine.add_request(prompt_ids, params)
    try:
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.request_id != rid:
                    continue
                if delta.token_ids and not reply.token_ids:
                    reply.ttft_s = time.perf_counter() - start
                reply.token_ids.extend(delta.token_ids)
                reply.text += delta.text
                reply.cached_tokens = delta.cached_tokens
                if delta.finish_reason is not None:
                    reply.finish_reason = delta.finish_reason
                if on_text is not None and delta.text:
                    on_text(delta.text)
    except KeyboardInterrupt:
        engine.abort(rid)
        raise
    reply.total_s = time.perf_counter() - start
    return reply


def _stderr_console() -> Console:  # imported late to keep the CLI light
    from rich.console import Console

    return Console(stderr=True)
