"""LLM: the offline Python API. Give it prompts, get finished outputs.

    from radixlm import LLM, SamplingParams
    llm = LLM()                                   # the default model
    outs = llm.generate(["Hello", [1, 2, 3], [{"role": "user", "content": "Hi"}]],
                        SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].cached_tokens, outs[0].metrics.ttft_s

A prompt is a string, a list of token ids, or a list of chat messages (rendered by the server's
own `PromptRenderer`, so a conversation gets the same ids here as served). All prompts are
queued at once, so the scheduler batches them and shares prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from radixlm.agents.prompt import PromptRenderer
from radixlm.api_types import RequestOutput, SamplingParams
from radixlm.config import (
    CacheConfig,
    CacheKind,
    ModelConfig,
    ModelDType,
    Policy,
    SchedulerConfig,
    Speculate,
)
from radixlm.engine.engine import Engine
from radixlm.engine.request import request_output

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: ModelDType = "auto",
        device: str = "cpu",
        num_threads: int | None = None,
        cache: CacheKind = "radix",
        num_slots: int = CacheConfig.num_slots,
        page_size: int = 1,
        policy: Policy = "lpm",
        chunk_size: int = SchedulerConfig.chunk_size,
        max_batch_tokens: int = SchedulerConfig.max_batch_tokens,
        max_running_requests: int = SchedulerConfig.max_running_requests,
        speculate: Speculate = SchedulerConfig.speculate,
    ) -> None:
        self.engine = Engine(
            ModelConfig(path=model, dtype=dtype, device=device, num_threads=num_threads),
            CacheConfig(num_slots=num_slots, page_size=page_size, cache=cache),
            SchedulerConfig(
                chunk_size=chunk_size,
                max_batch_tokens=max_batch_tokens,
                max_running_requests=max_running_requests,
                policy=policy,
                speculate=speculate,
            ),
        )
        self.tokenizer = self.engine.tokenizer
        self.renderer = PromptRenderer(self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of the prompts."""
        if _is_single_prompt(prompts):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(batch)
        else:
            params_list = list(params)
            if len(params_list) != len(batch):
                raise ValueError(f"{len(batch)} prompts but {len(params_list)} SamplingParams")
        ids = [
            self.engine.add_request(self.to_token_ids(p), sp, namespace=cache_salt)
            for p, sp in zip(batch, params_list)
        ]
        samples = {rid: self.engine.requests(rid) for rid in ids}
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:  # a failed forward pass belongs to every request in it
            self.engine.fail_all("internal error in the engine step")
            raise
        return [request_output(rid, samples[rid]) for rid in ids]

    def to_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        items: list[Any] = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            return self.renderer.prompt_ids(items)
        if all(isinstance(t, int) for t in items):
            return [int(t) for t in items]
        raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")


def _is_single_prompt(prompts: object) -> bool:
    if isinstance(prompts, str):
        return True
    items = list(prompts)  # type: ignore[call-overload]
    return bool(items) and all(isinstance(x, (int, dict)) for x in items)
