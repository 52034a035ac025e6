"""The engine: the step loop that turns requests into tokens without computing anything twice.

    step():  schedule -> build batch -> forward -> postprocess -> sample -> output

The scheduler decides who computes which tokens, hands out their slots and, after the forward
pass, advances the requests and commits their KV (it alone writes a request's KV state); the
runner computes logits; the sampler picks tokens; the output stage appends them, streams text and
retires finished requests. The engine is single-threaded: `AsyncEngine` runs it in a background
thread, `LLM` drives it synchronously.

Slot ownership over a request's life (the prefix cache keeps the account, the scheduler moves):
    admit    lock the matched node (tree slots), allocate the first chunk (in flight)
    prefill  every chunk is committed to the tree as soon as it is computed, so other requests
             can reuse it while the rest is still computing
    decode   one in-flight slot per generated token
    finish   commit prompt + output to the tree, unlock, free what the tree did not take
    abort    the same as finish, at any stage

Failures: an error that belongs to one request (its sampling state or logits row, its
detokenizer or stop checks) fails that request alone, all its samples, with finish_reason
"error", and the step goes on for the others; a failed forward pass belongs to every request in
it (step raises ForwardError naming them; its caller fails them with `fail`, and the requests
outside it go on). Either way every slot comes back.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm.agents.grammar import GrammarError
from radixlm.api_types import FinishReason, SamplingParams, StreamDelta
from radixlm.cache import create_prefix_cache
from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig
from radixlm.engine.request import Request, RequestState
from radixlm.engine.runner import ModelRunner
from radixlm.engine.sampler import SampledToken, Sampler, SamplingFailure
from radixlm.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from radixlm.model.forward_batch import ForwardBatch
from radixlm.model.loader import LoadProgress

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since the engine started (tokens are token positions computed by the model)."""

    steps: int = 0
    prefill_tokens: int = 0  # computed outside plain decode (what the cache tries to avoid)
    decode_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first sample only)
    cached_prompt_tokens: int = 0  # of those, served from the cache at admission
    finished_requests: int = 0  # ran to a stop or the length limit
    aborted_requests: int = 0  # aborted, or failed by an engine error


class QueueFullError(RuntimeError):
    """The waiting queue holds SchedulerConfig.max_waiting_requests: come back later."""


class ForwardError(RuntimeError):
    """The model's forward pass raised. `request_ids` were in it; the step's slots are back,
    and the caller decides their fate (`fail` them: the requests outside the pass go on)."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"the forward pass of {len(request_ids)} requests failed")
        self.request_ids = request_ids


class Engine:
    """Owns the runner (model + pool), the prefix cache, the scheduler and the sampler."""

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        progress: LoadProgress | None = None,  # hears the loading stages (a progress bar)
    ) -> None:
        self.model_config = model_config or ModelConfig()
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.runner = ModelRunner(self.model_config, self.cache_config, progress)
        self.tokenizer = self.runner.tokenizer
        self.cache = create_prefix_cache(self.cache_config, self.runner.pool)
        self.scheduler = Scheduler(self.scheduler_config, self.cache)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._requests: dict[str, list[Request]] = {}  # request id -> its n samples
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str | None = None,
    ) -> str:
        """Queue a request (as `params.n` samples). Raises ValueError when it can never run,
        QueueFullError when the waiting queue is full."""
        if self.scheduler.num_waiting >= self.scheduler_config.max_waiting_requests:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are waiting already")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt = [int(t) for t in prompt_ids]
        self._validate(prompt, params)
        samples = [
            Request(rid, prompt, params, self.tokenizer, namespace, index=i)
            for i in range(params.n)
        ]
        self.scheduler.add(samples)
        self._requests[rid] = samples
        return rid

    def abort(self, request_id: str) -> list[StreamDelta]:
        """Stop a request at any stage; every slot it held is freed or handed to the tree."""
        return self._stop(request_id, "abort")

    def fail(self, request_ids: Sequence[str], error: str) -> list[StreamDelta]:
        """Stop these requests with finish_reason "error" (after a ForwardError)."""
        return [d for rid in dict.fromkeys(request_ids) for d in self._stop(rid, "error", error)]

    def fail_all(self, error: str, reason: FinishReason = "error") -> list[StreamDelta]:
        """Stop every unfinished request (after an internal error, or at shutdown)."""
        return [d for rid in list(self._requests) for d in self._stop(rid, reason, error)]

    def _stop(
        self, request_id: str, reason: FinishReason, error: str | None = None
    ) -> list[StreamDelta]:
        samples = self._requests.get(request_id)
        if samples is None:
            return []
        deltas = []
        for req in samples:
            if req.finished:
                continue
            self.scheduler.remove(req)
            req.error = error
            deltas.append(self._finish(req, reason))
        self.stats.aborted_requests += 1
        return deltas

    def requests(self, request_id: str) -> list[Request]:
        """The samples of an unfinished request (they stay valid after it finishes)."""
        return list(self._requests[request_id])

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one scheduling + forward pass; return what each touched request produced."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        batch = _prepare_batch(plan.scheduled, self.runner.device)
        try:
            logits = self.runner.forward(batch)  # (R, vocab): the last new token of each request
        except Exception as exc:
            self.scheduler.cancel(plan.scheduled)
            raise ForwardError([s.req.rid for s in plan.scheduled]) from exc
        except BaseException:
            self.scheduler.cancel(plan.scheduled)
            raise
        self._count(plan)
        to_sample = self.scheduler.postprocess(plan.scheduled)
        if not to_sample:
            return []  # every request computed a chunk of a longer prefill
        outcomes = self.sampler.sample_each(
            logits[[s.row for s in to_sample]], [s.req.sampling for s in to_sample]
        )
        return self._output([s.req for s in to_sample], outcomes)

    # ---- helpers ----------------------------------------------------------------------------
    def _output(
        self, reqs: list[Request], outcomes: list[SampledToken | SamplingFailure]
    ) -> list[StreamDelta]:
        now = time.perf_counter()
        deltas: list[StreamDelta] = []
        for req, outcome in zip(reqs, outcomes, strict=True):
            if req.finished:  # failed with another sample of its request this step
                continue
            if isinstance(outcome, SamplingFailure):
                deltas += self._fail(req, "sampling", outcome.error)
            else:
                deltas += self._append_token(req, outcome, now)
        return deltas

    def _append_token(self, req: Request, sampled: SampledToken, now: float) -> list[StreamDelta]:
        token = sampled.token_id
        try:
            req.sampling.advance(token)  # the grammar, if any, follows every sampled token
        except GrammarError as exc:
            return self._fail(req, "following its grammar", exc)
        try:
            text, reason = req.output_stream.push(token)  # the one decider of why it ends
        except Exception as exc:  # the request's own detokenizer or stop checks
            return self._fail(req, "detokenizing", exc)
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_ids.append(token)
        req.all_ids.append(token)
        if sampled.logprobs is not None:
            req.logprobs.append(sampled.logprobs)
        if reason is not None:
            self.scheduler.remove(req)  # its KV goes to the tree, its lock is released
            return [self._finish(req, reason, text=text, new_tokens=[token])]
        return [self._delta(req, text, [token], None)]

    def _fail(self, req: Request, stage: str, error: Exception) -> list[StreamDelta]:
        """Fail one request (all its samples) over an error of its own; the others go on."""
        log.error("request %s failed while %s", req.rid, stage, exc_info=error)
        message = f"internal error while {stage} this request ({type(error).__name__})"
        return self._stop(req.rid, "error", message)

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        text: str = "",
        new_tokens: list[int] | None = None,
    ) -> StreamDelta:
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finished_time = time.perf_counter()
        if req.first_scheduled_time is None:
            req.first_scheduled_time = req.finished_time
        samples = self._requests[req.rid]
        if all(r.finished for r in samples):
            del self._requests[req.rid]
            if reason in ("stop", "length"):  # aborted and failed ones count in _stop
                self.stats.finished_requests += 1
        return self._delta(req, text, new_tokens or [], reason)

    def _delta(
        self, req: Request, text: str, tokens: list[int], reason: FinishReason | None
    ) -> StreamDelta:
        n = len(tokens)
        return StreamDelta(
            request_id=req.rid,
            index=req.index,
            text=text,
            token_ids=tokens,
            logprobs=req.logprobs[len(req.logprobs) - n :] if req.logprobs and n else [],
            finish_reason=reason,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cache_hit_len or 0,
            error=req.error,
        )

    def _count(self, plan: SchedulerOutput) -> None:
        """Count a computed step: prompts admitted for the first time, prefill and decode."""
        self.stats.steps += 1
        for req in plan.admitted:
            if req.index == 0:
                self.stats.prompt_tokens += req.prompt_len
                self.stats.cached_prompt_tokens += req.cache_hit_len or 0
        for item in plan.scheduled:
            if item.is_output_token:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += item.extend_len

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.runner.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})"
            )
        need = len(prompt) + params.max_tokens
        context = self.runner.max_context_len
        if need > context:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the model's context length of {context} tokens"
            )
        if need > self.cache.capacity:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"more KV slots than the pool holds ({self.cache.capacity})"
            )


def _prepare_batch(scheduled: list[ScheduledRequest], device: torch.device) -> ForwardBatch:
    return ForwardBatch.build(
        new_tokens=[s.req.all_ids[s.start : s.start + s.extend_len] for s in scheduled],
        prefix_slots=[s.req.slots for s in scheduled],
        new_slots=[s.new_slots for s in scheduled],
        device=device,
    )
