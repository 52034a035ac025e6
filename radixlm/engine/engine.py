"""The engine: the step loop that turns requests into tokens without computing anything twice.

    step():  schedule -> build batch -> forward -> postprocess -> sample -> output

With speculation (engine/speculate.py) a decoding request may verify a draft in its step: its
rows are sampled in turn, row j only while the model agreed with the draft's first j tokens, so
every token it emits is one the model sampled after exactly the tokens before it.

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
from radixlm.api_types import FinishReason, FirstTokenTimes, SamplingParams, StreamDelta
from radixlm.cache import create_prefix_cache
from radixlm.cache.drafts import TreeDrafts
from radixlm.config import CacheConfig, ModelConfig, SchedulerConfig
from radixlm.engine.batch import merge_deltas, prepare_batch
from radixlm.engine.limits import check_request
from radixlm.engine.request import Request, RequestState
from radixlm.engine.runner import ModelRunner
from radixlm.engine.sampler import SampledToken, Sampler, SamplingFailure
from radixlm.engine.scheduler import Scheduler
from radixlm.engine.speculate import Speculator
from radixlm.engine.step_plan import SampleRow, ScheduledRequest, SchedulerOutput
from radixlm.model.loader import LoadProgress
from radixlm.model.verify_rows import exact_rows

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
    output_tokens: int = 0  # tokens sampled and appended to outputs
    draft_tokens: int = 0  # draft tokens verified (rows computed beside the decode rows)
    accepted_tokens: int = 0  # of those, the ones the model agreed with
    forward_s: float = 0.0  # wall time inside the model's forward passes
    step_s: float = 0.0  # wall time inside step(): the forwards, scheduling, sampling, output


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
        self.speculator = Speculator(
            self.scheduler_config.speculate,
            TreeDrafts() if self.cache.shares_prefixes else None,
            exact_rows(self.runner.model, self.runner.pool),
        )
        self.scheduler = Scheduler(self.scheduler_config, self.cache, self.speculator)
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
        check_request(
            prompt, params, self.runner.vocab_size, self.runner.max_context_len,
            self.cache.capacity,
        )  # fmt: skip
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
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats.step_s += time.perf_counter() - started

    def _step(self) -> list[StreamDelta]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        batch = prepare_batch(plan.scheduled, self.runner.device)
        started = time.perf_counter()
        try:
            logits = self.runner.forward(batch)  # (R, vocab): each request's rows, in order
        except Exception as exc:
            self.scheduler.cancel(plan.scheduled)
            raise ForwardError([s.req.rid for s in plan.scheduled]) from exc
        except BaseException:
            self.scheduler.cancel(plan.scheduled)
            raise
        if all(s.extend_len == 1 for s in plan.scheduled):  # decode rows only: the row-cost fit
            self.speculator.observe_step(batch.num_tokens, time.perf_counter() - started)
        _note_forward(plan.scheduled, self.stats, time.perf_counter() - started)
        self._count(plan)
        to_sample = self.scheduler.postprocess(plan.scheduled)
        if not to_sample:
            return []  # every request computed a chunk of a longer prefill
        return merge_deltas(self._sample(to_sample, logits))

    # ---- helpers ----------------------------------------------------------------------------
    def _sample(self, rows: list[SampleRow], logits: torch.Tensor) -> list[StreamDelta]:
        """Sample every request's row; a request with a draft goes on to its next row while the
        token it sampled is the draft's next token (that row's KV is then kept): one batched
        sampler call per round. Sampling a row from the model's distribution and keeping the
        draft token only if it is the token drawn is the standard accept/reject rule for a
        deterministic draft: the draft token is kept with probability p(d), and a rejected row
        yields a token from p restricted to the others. One uniform per emitted token, as in
        plain decoding, so a seeded request gets the same tokens with speculation on or off."""
        started = now = time.perf_counter()
        deltas: list[StreamDelta] = []
        accepted = [0] * len(rows)
        ahead = self._sample_ahead(rows, logits)
        live, depth = list(range(len(rows))), 0
        while live:
            need = [i for i in live if i not in ahead]
            fresh = dict(zip(need, self.sampler.sample_each(
                logits[[rows[i].row + depth for i in need]], [rows[i].req.sampling for i in need]
            ))) if need else {}  # fmt: skip
            if depth == 0:  # the timeline's sampling, noted before any first token is appended
                now = time.perf_counter()  # the first token's time: once it is sampled
                _note_sampling([rows[i] for i in live], now - started)
            going = []
            for i in live:
                outcome = ahead[i][depth] if i in ahead else fresh[i]
                req, draft = rows[i].req, rows[i].draft
                if req.finished:  # failed with another sample of its request this step
                    continue
                deltas += self._output(req, outcome, now)
                if (
                    draft is not None
                    and depth < len(draft.tokens)
                    and not req.finished
                    and req.output_ids[-1] == draft.tokens[depth]
                ):
                    self.scheduler.accept_draft(req)
                    accepted[i] += 1
                    going.append(i)
            live, depth = going, depth + 1
        for r, kept in zip(rows, accepted, strict=True):
            if r.draft is not None:
                self.scheduler.end_verify(r.req, r.draft, kept)
                self.stats.accepted_tokens += kept
        return deltas

    def _sample_ahead(
        self, rows: list[SampleRow], logits: torch.Tensor
    ) -> dict[int, list[SampledToken | SamplingFailure]]:
        """Every row of the verify requests whose rows do not depend on the tokens kept before
        them (greedy; no penalties, grammar or min_tokens ban in play), in one batched sampler
        call instead of one per round: the same tokens the rounds would sample."""
        chosen = [i for i, r in enumerate(rows) if r.draft is not None and _row_free(r.req)]
        if not chosen:
            return {}
        spans = [(i, len(rows[i].draft.tokens) + 1) for i in chosen]  # type: ignore[union-attr]
        index = [rows[i].row + j for i, n in spans for j in range(n)]
        states = [rows[i].req.sampling for i, n in spans for _ in range(n)]
        outcomes = self.sampler.sample_each(logits[index], states)
        ahead, at = {}, 0
        for i, n in spans:
            ahead[i], at = outcomes[at : at + n], at + n
        return ahead

    def _output(
        self, req: Request, outcome: SampledToken | SamplingFailure, now: float
    ) -> list[StreamDelta]:
        if isinstance(outcome, SamplingFailure):
            return self._fail(req, "sampling", outcome.error)
        self.stats.output_tokens += 1
        return self._append_token(req, outcome, now)

    def _append_token(self, req: Request, sampled: SampledToken, now: float) -> list[StreamDelta]:
        token = sampled.token_id
        try:
            req.sampling.advance(token)  # the grammar, if any, follows every sampled token
        except GrammarError as exc:
            return self._fail(req, "following its grammar", exc)
        started = time.perf_counter()
        try:
            text, reason = req.output_stream.push(token)  # the one decider of why it ends
        except Exception as exc:  # the request's own detokenizer or stop checks
            return self._fail(req, "detokenizing", exc)
        if req.first_token_time is None:
            req.first_token_time = now
            req.first_token_work.detokenize_s = time.perf_counter() - started
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
            drafted_tokens=self._drafted(req),
            accepted_tokens=req.speculation.accepted if req.speculation else 0,
            first_token=_first_token_times(req) if n and len(req.output_ids) == n else None,
        )

    def _drafted(self, req: Request) -> int | None:
        if not self.speculator.enabled:
            return None
        return req.speculation.drafted if req.speculation else 0

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
            self.stats.draft_tokens += item.num_rows - 1


def _row_free(req: Request) -> bool:
    """Whether a request's next rows sample the same tokens whatever it kept before them."""
    p = req.params
    return (
        p.greedy
        and req.sampling.matcher is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and len(req.output_ids) >= p.min_tokens
    )


def _note_forward(scheduled: list[ScheduledRequest], stats: EngineStats, seconds: float) -> None:
    """Count a forward pass: in the engine's total, and for each request still waiting for its
    first token."""
    stats.forward_s += seconds
    for item in scheduled:
        if item.req.first_token_time is None:
            work = item.req.first_token_work
            work.forward_s += seconds
            work.num_forwards += 1


def _note_sampling(rows: list[SampleRow], seconds: float) -> None:
    for row in rows:
        if row.req.first_token_time is None:
            row.req.first_token_work.sample_s = seconds


def _first_token_times(req: Request) -> FirstTokenTimes:
    """The engine's part of the timeline, once `req` has its first token."""
    work, sampled = req.first_token_work, req.first_token_time
    assert sampled is not None  # called for the delta carrying the first token
    return FirstTokenTimes(
        received=req.arrival_time,
        scheduled=req.first_scheduled_time or sampled,
        sampled=sampled,
        match_s=work.match_s,
        forward_s=work.forward_s,
        num_forwards=work.num_forwards,
        sample_s=work.sample_s,
        detokenize_s=work.detokenize_s,
    )
