"""Speculation: which tokens a decoding request drafts for its next step, and how many.

A decode step reads every weight once whatever its number of rows, so on a CPU a step that
verifies a few guessed tokens costs little more than one that decodes a single token. A draft is
a guess the model checks in the same step (verify rows, model/verify_rows.py); the engine keeps
the longest run the model agrees with, plus the model's own next token. Sources, in order:

    grammar  the tokens the request's grammar forces next (llguidance's fast-forward tokens: a
             JSON key, a tool name, closing braces): jump-forward, several tokens in one step
    prompt   a continuation of the request's last NGRAM tokens found earlier in its own prompt
             and output (the tool argument copied from an observation, the file being edited)
    tree     one found in the radix tree's paths of the request's namespace (cache/drafts.py):
             what other requests of the same tenant wrote after the same tokens

A draft that was accepted is followed (its cursor) while the request keeps matching it, so a
long copy continues from the same place rather than the latest place its last tokens occur.

How many: each request keeps a decayed count of accepted and rejected draft tokens, so draft
token j is kept with probability about a^j (a its acceptance rate; forced tokens: 1). A step of
n rows costs about 1 + r n (the weights streamed once, and r per row; `StepCost` fits r to the
steps the engine times), so a draft row pays when it raises the step's expected tokens per unit
of cost: `choose` adds rows across all the step's requests, likeliest first, while
a^j (1 + r n) > r E (E: the step's expected tokens so far). A lone request copying well drafts
many tokens; in a large batch, where rows are what a step costs, few; a request whose drafts
fail, or with nothing to copy, none (a plain decode: a lookup, no row).

Neighbours: a step's draft rows slow every request in it, and the requests that draft nothing
gain nothing from them. So where a step carries rows of requests without a draft, its draft
rows may raise its cost by at most NEIGHBOUR_SLOWDOWN (1 + r n' <= NEIGHBOUR_SLOWDOWN (1 + r n)):
one request copying well beside others can no longer multiply their inter-token latency
(measured by benchmarks/neighbour_latency.py: a request whose output repeats "a" beside a
neighbour made the neighbour's steps 2.7x slower than a plain decode beside it did).

Modes (SchedulerConfig.speculate): "off"; "tree" drafts on any backend; "auto" drafts where the
backend gives verify rows a decode step's bits (exact_rows > 1), so greedy output stays
token-identical with speculation on and off, and keeps every step within exact_rows rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from radixlm.cache.drafts import NGRAM, TreeDrafts, TreeSpot, read_path
from radixlm.cache.tree_node import TreeNode
from radixlm.config import Speculate
from radixlm.model.verify_rows import UNBOUNDED

if TYPE_CHECKING:
    from radixlm.engine.request import Request

DraftSource = Literal["grammar", "prompt", "tree"]
SOURCES: tuple[DraftSource, ...] = ("grammar", "prompt", "tree")
MAX_DRAFT_LEN = 16  # the longest draft a request verifies in one step
HIT_DECAY = 0.7  # weight of the past in the acceptance counts, per verify
IDLE_DECAY = 0.9  # per step drafted nothing: the counts drift back toward the prior
PRIOR_HITS, PRIOR_MISSES = 2.0, 1.0  # a first draft is worth trying: a = 2/3
NEIGHBOUR_SLOWDOWN = 1.5  # the most drafts may slow a step that carries rows without a draft


class Draft(NamedTuple):
    tokens: tuple[int, ...]
    source: DraftSource


class Proposal(NamedTuple):
    """The longest draft a request would verify now, and the chance each next token is kept."""

    req: Request
    draft: Draft
    rate: float


class Cursor(NamedTuple):
    """Where the last draft came from: its source, the request's length then, and the place
    of the draft's first token (an index into the request's ids, or a tree position)."""

    source: DraftSource
    at: int
    pos: int
    node: TreeNode | None = None


@dataclass
class DraftState:
    """One request's drafting state (written by the Speculator only)."""

    ids: np.ndarray = field(default_factory=lambda: np.empty(256, dtype=np.int64))
    num_ids: int = 0  # ids[:num_ids] mirror the request's all_ids
    cursor: Cursor | None = None
    hits: float = 0.0  # decayed accepted draft tokens
    misses: float = 0.0  # decayed rejected drafts
    drafted: int = 0  # totals, for the usage
    accepted: int = 0

    def sync(self, all_ids: list[int]) -> np.ndarray:
        """The request's ids as an array (appending what was sampled since the last call)."""
        n = len(all_ids)
        if n > len(self.ids):
            grown = np.empty(max(n, 2 * len(self.ids)), dtype=np.int64)
            grown[: self.num_ids] = self.ids[: self.num_ids]
            self.ids = grown
        if n > self.num_ids:
            self.ids[self.num_ids : n] = all_ids[self.num_ids : n]
            self.num_ids = n
        return self.ids[:n]

    @property
    def rate(self) -> float:
        """The chance that the next draft token is kept (decayed counts over a prior)."""
        return (self.hits + PRIOR_HITS) / (self.hits + self.misses + PRIOR_HITS + PRIOR_MISSES)


class StepCost:
    """A decode step's time as fixed + per-row, t = a + b n, fitted by decayed least squares to
    the steps the engine times; `row_cost` = b / a (r above), PRIOR_ROW_COST until the steps
    seen vary enough in rows to tell."""

    PRIOR_ROW_COST = 0.15  # the default model's quantized rows on a 2-core EPYC: docs/engine.md
    DECAY = 0.98  # per observed step

    def __init__(self, fixed: float | None = None) -> None:
        self.fixed = fixed  # a row cost that never moves (tests, and hosts too noisy to fit)
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self._w, self._n, self._t = d * self._w + 1, d * self._n + rows, d * self._t + seconds
        self._nn, self._nt = d * self._nn + rows * rows, d * self._nt + rows * seconds

    @property
    def row_cost(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if self._w < 8:
            return self.PRIOR_ROW_COST
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var < 1.0:  # every step had about as many rows: no slope to read
            return self.PRIOR_ROW_COST
        slope = (self._nt / self._w - mean_n * mean_t) / var
        fixed = mean_t - slope * mean_n
        if fixed <= 0 or slope <= 0:
            return self.PRIOR_ROW_COST
        return min(max(slope / fixed, 0.01), 1.0)


class Speculator:
    """Drafts for the scheduler; keeps each request's DraftState and the tree's run index."""

    def __init__(self, mode: Speculate, drafts: TreeDrafts | None, exact_rows: int) -> None:
        self.mode = mode
        self.drafts = drafts  # None without a radix tree (the no-cache ablation)
        self.enabled = mode == "tree" or (mode == "auto" and exact_rows > 1)
        # the rows a step may carry with drafts in it: where the backend promises a row its
        # lone bits at up to exact_rows rows, drafts stay within them
        self.max_rows = exact_rows if exact_rows > 1 else UNBOUNDED
        self.drafted: Counter[DraftSource] = Counter()
        self.accepted: Counter[DraftSource] = Counter()
        self.cost = StepCost()

    def propose(self, req: Request, limit: int) -> Proposal | None:
        """The longest draft (at most `limit` tokens) `req` would verify after its last token,
        or None (a plain decode). Reads the request and the tree; writes only req.speculation."""
        if not self.enabled or limit <= 0:
            return None
        state = req.speculation
        if state is None:
            state = req.speculation = DraftState()
        ids = state.sync(req.all_ids)
        k = min(limit, MAX_DRAFT_LEN)
        matcher = req.sampling.matcher
        if matcher is not None:
            forced = matcher.forced_tokens()[:k]
            if forced:
                return Proposal(req, Draft(tuple(forced), "grammar"), 1.0)
        draft = self._follow(state, ids, k, req) or self._find(state, ids, k, req)
        if draft is not None and matcher is not None:  # only what the grammar allows
            draft = Draft(draft.tokens[: matcher.valid_prefix_len(draft.tokens)], draft.source)
        if draft is None or not draft.tokens:
            return None
        return Proposal(req, draft, state.rate)

    def choose(self, proposals: list[Proposal], rows: int, room: int) -> list[Draft | None]:
        """Each proposal's draft cut to the rows that pay in a step of `rows` rows without
        drafts (see the module docstring), at most `room` draft rows in all; None: no row.
        A proposal that gets no row decays its request's counts toward the prior."""
        r = self.cost.row_cost
        if rows > len(proposals):  # requests without a draft share the step: bound its cost
            room = min(room, int((NEIGHBOUR_SLOWDOWN - 1) * (1 + r * rows) / r))
        n, expected = rows, float(rows)  # every row without a draft yields one token
        lengths = [0] * len(proposals)
        candidates = sorted(
            (-(p.rate**j), j, i)
            for i, p in enumerate(proposals)
            for j in range(1, len(p.draft.tokens) + 1)
        )  # likeliest first; a request's rows in order
        for neg_p, j, i in candidates:
            if n - rows >= room:
                break
            if j != lengths[i] + 1:
                continue
            if -neg_p * (1 + r * n) <= r * expected:
                break  # no row left raises expected tokens per unit of cost
            lengths[i], n, expected = j, n + 1, expected - neg_p
        out: list[Draft | None] = []
        for p, k in zip(proposals, lengths, strict=True):
            if k == 0 and p.req.speculation is not None:
                p.req.speculation.hits *= IDLE_DECAY
                p.req.speculation.misses *= IDLE_DECAY
            out.append(Draft(p.draft.tokens[:k], p.draft.source) if k else None)
        return out

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of decode and verify rows only took `seconds` (the row-cost fit)."""
        self.cost.observe(rows, seconds)

    def verified(self, req: Request, draft: Draft, accepted: int) -> None:
        """`accepted` of the draft's tokens were kept: update the request's acceptance."""
        self.drafted[draft.source] += len(draft.tokens)
        self.accepted[draft.source] += accepted
        state = req.speculation
        if state is None:
            return
        state.drafted += len(draft.tokens)
        state.accepted += accepted
        if draft.source == "grammar":
            return  # forced runs say nothing of how well copies go
        state.hits = state.hits * HIT_DECAY + accepted
        state.misses = state.misses * HIT_DECAY + (accepted < len(draft.tokens))

    def finished(self, req: Request, node: TreeNode) -> None:
        """`req` ended with its path committed up to `node`: index what it added to the tree."""
        if self.drafts is None or not self.enabled:
            return
        state = req.speculation or DraftState()
        ids = state.sync(req.all_ids)
        self.drafts.remember(req.namespace, node, ids, req.cache_hit_len or 0)

    def stats(self) -> dict[str, dict[str, int]]:
        """Drafted and accepted tokens per source, since the start."""
        return {s: {"drafted": self.drafted[s], "accepted": self.accepted[s]} for s in SOURCES}

    # ---- where a draft comes from -------------------------------------------------------------
    def _follow(self, state: DraftState, ids: np.ndarray, k: int, req: Request) -> Draft | None:
        """The continuation of the last draft's source, if the request kept to it."""
        cursor, state.cursor = state.cursor, None
        if cursor is None:
            return None
        new = ids[cursor.at :]  # sampled since that draft: accepted tokens and the next one
        if cursor.source == "prompt":
            pos = cursor.pos + len(new)
            if not np.array_equal(ids[cursor.pos : pos], new):
                return None
            return self._from_ids(state, ids, pos, k)
        assert cursor.node is not None
        ahead = read_path(TreeSpot(cursor.node, cursor.pos), len(new) + k)
        if len(ahead) <= len(new) or not np.array_equal(ahead[: len(new)], new):
            return None
        state.cursor = Cursor("tree", len(ids), cursor.pos + len(new), cursor.node)
        return Draft(ahead[len(new) :], "tree")

    def _find(self, state: DraftState, ids: np.ndarray, k: int, req: Request) -> Draft | None:
        """A continuation of the request's last NGRAM tokens: its own tokens first (the most
        recent earlier occurrence), then the tree."""
        n = len(ids)
        if n <= NGRAM:
            return None
        last = ids[n - NGRAM :]
        match = ids[: n - NGRAM] == last[0]
        for j in range(1, NGRAM):
            match[: n - NGRAM] &= ids[j : n - NGRAM + j] == last[j]
        starts = np.flatnonzero(match)
        if len(starts):
            return self._from_ids(state, ids, int(starts[-1]) + NGRAM, k)
        if self.drafts is None:
            return None
        for spot in self.drafts.lookup(req.namespace, last):
            tokens = read_path(spot, k)
            if tokens:
                state.cursor = Cursor("tree", n, spot.depth, spot.node)
                return Draft(tokens, "tree")
        return None

    @staticmethod
    def _from_ids(state: DraftState, ids: np.ndarray, pos: int, k: int) -> Draft | None:
        tokens = ids[pos : pos + k]
        if not len(tokens):
            return None
        state.cursor = Cursor("prompt", len(ids), pos)
        return Draft(tuple(int(t) for t in tokens), "prompt")
