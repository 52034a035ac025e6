"""The scheduler: which requests compute how many tokens in the next forward, and their KV.

It owns the waiting and running queues and is the one writer of a request's KV state (`node`,
`slots`, `cached_len`, `computed_len`) and the one caller of the prefix cache for requests
(match, lock, alloc, commit, release). One step, as the engine drives it:

    schedule()         decode: every running request with one token left gets one slot (oldest
                       first); prefill: requests in a chunked prefill get their next chunk;
                       admit: waiting requests, in policy order (longest cached prefix first,
                       with an age bound), while the token budget, the running cap and memory
                       allow.
    postprocess(plan)  after the forward pass: each request advances past the tokens it
                       computed, prefilled KV is committed to the tree (others reuse it at
                       once), and the requests to sample come back with their logits rows,
                       the forks of an n > 1 request started on their leader's prompt.
    cancel(plan)       the forward pass failed: the step's slots go back, nothing advances.

A ScheduledRequest records where its step starts, so nothing downstream depends on when
`computed_len` moves.

Drafts (engine/speculate.py): once the step's decodes, prefill chunks and admissions are set, a
decoding request may also verify a draft in the same step, within what is left of the token
budget (draft tokens count in it) and of the rows the speculator allows, on free slots only (a
guess never evicts the cache or retracts a request). After the forward pass the draft rows'
slots are the request's `draft_slots`; the engine keeps the accepted ones (`accept_draft`) and
`end_verify` frees the rest in the same step.

Memory never deadlocks: when a running request cannot get a slot, the newest running request is
retracted — its computed KV is committed to the tree, so it resumes with a cache hit — and
requeued at the front. `Engine.add_request` refuses a request that cannot fit the pool alone, so
the oldest
running request always makes progress.

In-batch sharing: a waiting request whose uncached prefix is being computed right now by another
request (tracked in a scratch radix tree of in-progress sequences) waits for that computation to
enter the tree instead of computing the same tokens again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from radixlm.cache.kv_pool import OutOfSlotsError
from radixlm.cache.prefix_cache import PendingMatch, PrefixCache
from radixlm.cache.radix_tree import MatchResult, RadixTree, TreeNode
from radixlm.cache.tree_node import DEFAULT_RETENTION, KEEP, RAM_ONLY
from radixlm.config import SchedulerConfig
from radixlm.engine.request import Request, RequestState
from radixlm.engine.speculate import Draft, Speculator
from radixlm.engine.step_plan import SampleRow, ScheduledRequest, SchedulerOutput

# SamplingParams.cache_retention -> what the tree stamps on the nodes a request inserts
RETENTION = {None: DEFAULT_RETENTION, "in_memory": RAM_ONLY, "24h": KEEP}


class Scheduler:
    """Waiting and running queues over a prefix cache (see the module docstring)."""

    def __init__(
        self, config: SchedulerConfig, cache: PrefixCache, speculator: Speculator | None = None
    ) -> None:
        self.config = config
        self.cache = cache
        self.speculator = speculator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self._loads: dict[int, PendingMatch] = {}  # id(waiting request) -> its prefix loading
        self.num_retractions = 0

    # ---- queues ---------------------------------------------------------------------------
    def add(self, samples: Sequence[Request]) -> None:
        """Queue the samples of one request (n of them). The caller has checked that they fit
        the pool and the context. With a cache that shares prefixes the first prefills alone and
        the others fork from it: `postprocess` starts them on its committed prompt and samples
        them from its logits row."""
        if self.cache.shares_prefixes:
            samples[0].forks = list(samples[1:])
            samples = samples[:1]
        for req in samples:
            self._enqueue(req)
            self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues, returning or handing over all its slots.

        Computed KV of a running request is committed to the tree (a retry will hit it); the rest
        is freed. Mutates the cache; the request holds no lock and no slot afterwards. A fork
        still waiting for its leader's prompt holds nothing and is in no queue: the caller
        finishes it, and a finished fork is never started.
        """
        if req.state is RequestState.WAITING:
            if req in self.waiting:
                self.waiting.remove(req)
            pending = self._loads.pop(id(req), None)
            if pending is not None:
                self.cache.finish_load(pending)  # its slots and lock go back
        elif req.state is RequestState.RUNNING:
            self.running.remove(req)
            self._drop_kv(req, finished=True)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build the next step (see the module docstring). Mutates the queues, the requests
        admitted or retracted, and the cache (alloc, and match + lock for admissions)."""
        out = SchedulerOutput()
        budget = self.config.max_batch_tokens
        scheduled: set[int] = set()
        # One token left first, oldest first: decodes (and prefills down to their last token;
        # ScheduledRequest.is_output_token tells the two apart).
        for req in [r for r in self.running if r.remaining_len == 1]:
            if budget == 0:
                break
            if req.state is RequestState.RUNNING and self._extend(req, 1, out, scheduled):
                budget -= 1
        for req in [r for r in self.running if r.remaining_len > 1]:  # chunked prefill
            if budget == 0:
                break
            n = min(req.remaining_len, self.config.chunk_size, budget)
            if req.state is RequestState.RUNNING and self._extend(req, n, out, scheduled):
                budget -= n
        self._admit(budget, out)
        self._draft(out)
        if not out.scheduled and self._loads:  # nothing to compute: wait for the disk, not spin
            self.cache.wait_loads(list(self._loads.values()), timeout_s=0.05)
        return out

    def _extend(self, req: Request, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Give a running request n slots, retracting newer requests while memory is short."""
        while True:
            try:
                slots = self.cache.alloc(n)
            except OutOfSlotsError:
                victim = self._newest_unscheduled(scheduled)
                if victim is None:
                    return False
                self._retract(victim, out)
                if victim is req:
                    return False
                continue
            out.scheduled.append(ScheduledRequest(req, req.computed_len, n, slots))
            scheduled.add(id(req))
            return True

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting requests in policy order while budget, running cap and memory allow."""
        if not self.waiting:
            return
        in_progress = self._in_progress_tree()
        admitted: list[Request] = []
        for req in self._waiting_order():
            if budget == 0 or len(self.running) >= self.config.max_running_requests:
                break
            started = time.perf_counter()
            match = self._match(req)
            req.first_token_work.match_s += time.perf_counter() - started
            if match is None:
                continue  # its prefix is loading from disk: admitted once it is in RAM
            if in_progress is not None:
                shared = in_progress.peek(req.lookup_key, req.namespace)
                if shared > match.length:
                    # Another request is computing more of this prefix right now: wait for it
                    # to enter the tree (at most a chunk away) rather than compute it twice.
                    continue
            n = min(req.seq_len - match.length, self.config.chunk_size, budget)
            self.cache.lock(match.node)
            try:
                slots = self.cache.alloc(n)
            except OutOfSlotsError:
                self.cache.unlock(match.node)
                break  # memory is full: admit nothing more this step
            if req.cache_hit_len is None:
                out.admitted.append(req)
            self._start(req, match.node, match.slots, match.length)
            admitted.append(req)
            out.scheduled.append(ScheduledRequest(req, req.computed_len, n, slots))
            budget -= n
            if in_progress is not None:
                in_progress.insert(req.all_ids, _placeholder_slots(req.seq_len), req.namespace)
        for req in admitted:
            self.waiting.remove(req)
        for req in self.waiting:
            req.wait_steps += 1

    def _draft(self, out: SchedulerOutput) -> None:
        """Drafts for the step's decoding requests, oldest first, within the budget and rows
        left and the free slots (see the module docstring)."""
        spec = self.speculator
        if spec is None or not spec.enabled:
            return
        used = sum(item.num_tokens for item in out.scheduled)
        room = min(min(self.config.max_batch_tokens, spec.max_rows) - used, self.cache.num_free)
        if room <= 0:
            return
        where, proposals = [], []
        for i, item in enumerate(out.scheduled):
            req = item.req
            if item.extend_len != 1 or item.start == 0 or req.remaining_len != 1 or req.forks:
                continue  # it samples no token this step, or its forks share its row
            left = req.params.max_tokens - len(req.output_ids) - 1  # the last token is sampled
            proposal = spec.propose(req, min(room, left))
            if proposal is not None:
                where.append(i)
                proposals.append(proposal)
        if not proposals:
            return
        for i, draft in zip(where, spec.choose(proposals, used, room), strict=True):
            if draft is None:
                continue
            item = out.scheduled[i]
            slots = self.cache.alloc(len(draft.tokens))  # free slots: nothing is evicted
            new_slots = np.concatenate([item.new_slots, slots])
            out.scheduled[i] = ScheduledRequest(item.req, item.start, 1, new_slots, draft)

    def _match(self, req: Request) -> MatchResult | None:
        """The request's cached prefix, or None while a lower tier loads it (others keep
        computing meanwhile; the load ends when its reads do or after a timeout)."""
        pending = self._loads.pop(id(req), None)
        if pending is None:
            got = self.cache.match_or_load(req.lookup_key, req.namespace)
            if isinstance(got, MatchResult):
                return got
            pending = got
        if not pending.ready():
            self._loads[id(req)] = pending
            return None
        return self.cache.finish_load(pending)

    def _waiting_order(self) -> list[Request]:
        """FCFS, or LPM: requests past the age bound first (oldest first), then the longest
        cached prefix first (ties by arrival).

        The cached prefix is what the request will not compute: its RAM prefix and the L2
        continuation its match would load (`cache.peek`), L2 tokens counted in full. Ranking
        a request ahead only starts its load (it is admitted when the reads are done, others
        compute meanwhile), and a page read costs about 1 % of recomputing it, so an L2 token
        saves as much prefill as an L1 token does; a discount would only start its load later
        and leave the disk idle while the engine computes."""
        if self.config.policy == "fcfs":
            return list(self.waiting)
        aged = [r for r in self.waiting if r.wait_steps >= self.config.max_wait_steps]
        fresh = [r for r in self.waiting if r.wait_steps < self.config.max_wait_steps]
        version = self.cache.version
        for r in fresh:  # re-peek only when the tree has changed since the last look
            if r.hint_version != version:
                r.match_hint = self.cache.peek(r.lookup_key, r.namespace)
                r.hint_version = version
        fresh.sort(key=lambda r: -r.match_hint)  # stable: ties keep arrival order
        return aged + fresh

    def _in_progress_tree(self) -> RadixTree | None:
        """A scratch tree of sequences being prefilled now (None when the cache never shares)."""
        if not self.cache.shares_prefixes:
            return None
        tree = RadixTree(page_size=1)
        for req in self.running:
            if req.remaining_len > 1:
                tree.insert(req.all_ids, _placeholder_slots(req.seq_len), req.namespace)
        return tree

    # ---- after the forward pass -------------------------------------------------------------
    def postprocess(self, scheduled: Sequence[ScheduledRequest]) -> list[SampleRow]:
        """Advance every scheduled request past the tokens it computed; return who samples.

        Prefilled KV is committed to the tree at once, so other requests reuse it while the
        rest is still computing (decoded tokens enter the tree when the request ends). A request
        samples when its computation reached the end of its tokens; then the forks of an n > 1
        request start on its committed prompt and sample from the same row. Mutates the
        requests' KV fields and the cache (commit; match + lock for the forks).
        """
        rows: list[SampleRow] = []
        row = 0  # each request's first logits row
        for item in scheduled:
            req = item.req
            req.slots = np.concatenate([req.slots, item.new_slots[: item.extend_len]])
            req.draft_slots = item.new_slots[item.extend_len :]
            req.computed_len = item.start + item.extend_len
            if not item.is_output_token:
                self._commit(req)
            first, row = row, row + item.num_rows
            if req.remaining_len > 0:
                continue  # a chunk of a longer prefill: nothing to sample yet
            rows.append(SampleRow(req, first, item.draft))
            rows += [SampleRow(fork, first) for fork in self._start_forks(req)]
        return rows

    def accept_draft(self, req: Request) -> None:
        """The token the engine just appended to `req` is the one its next draft row computed:
        that row's KV (its first draft slot) becomes part of the request's."""
        req.slots = np.concatenate([req.slots, req.draft_slots[:1]])
        req.draft_slots = req.draft_slots[1:]
        req.computed_len += 1

    def end_verify(self, req: Request, draft: Draft, accepted: int) -> None:
        """The step's sampling is over: free the draft rows the request did not keep (a request
        that finished already gave them back) and tell the speculator how the draft went."""
        if len(req.draft_slots):
            self.cache.free(req.draft_slots)
            req.draft_slots = np.empty(0, dtype=np.int64)
        if self.speculator is not None:
            self.speculator.verified(req, draft, accepted)

    def cancel(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """The forward pass failed: free the step's slots, draft slots included (no request
        holds them yet). Nothing advanced: a request admitted this step stays running on its
        locked prefix."""
        for item in scheduled:
            self.cache.free(item.new_slots)

    # ---- slot ownership transitions --------------------------------------------------------
    def _start(self, req: Request, node: TreeNode, slots: np.ndarray, cached_len: int) -> None:
        """Running, on a locked tree prefix of `cached_len` tokens held in `slots`."""
        req.state = RequestState.RUNNING
        req.node = node
        req.slots = slots
        req.cached_len = cached_len
        req.computed_len = cached_len
        req.wait_steps = 0
        if req.cache_hit_len is None:
            req.cache_hit_len = min(cached_len, req.prompt_len)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
        self.running.append(req)

    def _start_forks(self, leader: Request) -> list[Request]:
        """Forks of an n > 1 request share the leader's prompt KV (via the tree) and logits."""
        forks, leader.forks = [f for f in leader.forks if not f.finished], []
        started = []
        for fork in forks:
            match = self.cache.match(fork.all_ids, fork.namespace)
            if match.length < fork.seq_len:  # the tree could not take the whole prompt (pages)
                self._enqueue(fork)
                self.waiting.append(fork)
                continue
            self.cache.lock(match.node)
            self._start(fork, match.node, match.slots, match.length)
            started.append(fork)
        return started

    def _commit(self, req: Request) -> None:
        """Hand the request's computed whole pages to the tree; it goes on from the tree's."""
        assert req.node is not None  # every running request holds a node
        ids, retention = req.all_ids[: req.computed_len], RETENTION[req.params.cache_retention]
        res = self.cache.commit(ids, req.slots, req.namespace, req.node, retention)
        req.node, req.slots, req.cached_len = res.node, res.slots, res.cached_len

    def _retract(self, req: Request, out: SchedulerOutput) -> None:
        """Hand a running request's KV to the tree and requeue it at the front."""
        self.running.remove(req)
        self._drop_kv(req, finished=False)
        self._enqueue(req)
        self.waiting.appendleft(req)
        out.retracted.append(req)
        self.num_retractions += 1

    def _enqueue(self, req: Request) -> None:
        req.state = RequestState.WAITING
        # What admission will match: everything but the last token, whose logits are needed.
        req.lookup_key = np.asarray(req.all_ids[:-1], dtype=np.int64)
        req.hint_version = None

    def _drop_kv(self, req: Request, finished: bool) -> None:
        """Commit what the request computed, then release: unlock, free what stays in flight
        (`finished`: done or aborted, not retracted)."""
        self._commit(req)
        assert req.node is not None
        if finished and self.speculator is not None:
            self.speculator.finished(req, req.node)  # its path, for other requests' drafts
        in_flight = np.concatenate([req.slots[req.cached_len :], req.draft_slots])
        self.cache.release(req.node, in_flight, finished)
        req.node = None
        req.slots = np.empty(0, dtype=np.int64)
        req.draft_slots = np.empty(0, dtype=np.int64)
        req.cached_len = 0
        req.computed_len = 0

    def _newest_unscheduled(self, scheduled: set[int]) -> Request | None:
        for req in reversed(self.running):
            if id(req) not in scheduled:
                return req
        return None


def _placeholder_slots(n: int) -> np.ndarray:
    # The scratch tree only answers "how much is shared"; its slot values are never read.
    return np.zeros(n, dtype=np.int64)
