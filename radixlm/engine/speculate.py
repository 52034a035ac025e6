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

How many: each request keeps a decayed count of accepted and rejected draft tokens, and drafts
the k that maximises expected tokens per step over its cost, (1 - a^(k+1)) / (1 - a) tokens for
1 + ROW_COST k decode steps, a its acceptance rate; k = 0 (a plain decode) when no draft pays
or there is nothing to copy, which costs a lookup and no row. Forced tokens are always drafted.

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
# A draft row's cost in decode steps: a row adds its LM-head and attention work to a step that
# streams the weights once (measured on the default model, 2-core EPYC: docs/engine.md).
ROW_COST = 0.1
MAX_DRAFT_LEN = 16  # the longest draft a request verifies in one step
HIT_DECAY = 0.7  # weight of the past in the acceptance counts, per verify
IDLE_DECAY = 0.9  # per step without a draft: the counts drift back toward the prior
PRIOR_HITS, PRIOR_MISSES = 2.0, 1.0  # a first draft is worth trying: a = 2/3


class Draft(NamedTuple):
    tokens: tuple[int, ...]
    source: DraftSource


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

    def draft_len(self, limit: int) -> int:
        """The k that maximises expected tokens per unit of cost (0: no draft pays)."""
        rate = (self.hits + PRIOR_HITS) / (self.hits + self.misses + PRIOR_HITS + PRIOR_MISSES)
        best_k, best, expected = 0, 1.0, 1.0
        for k in range(1, limit + 1):
            expected += rate**k  # 1 + a + ... + a^k
            value = expected / (1 + ROW_COST * k)
            if value > best:
                best_k, best = k, value
        return best_k


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

    def propose(self, req: Request, limit: int) -> Draft | None:
        """At most `limit` tokens to verify after `req`'s last token, or None (a plain decode).
        Reads the request and the tree; writes only req.speculation."""
        if not self.enabled or limit <= 0:
            return None
        state = req.speculation
        if state is None:
            state = req.speculation = DraftState()
        ids = state.sync(req.all_ids)
        matcher = req.sampling.matcher
        if matcher is not None:
            forced = matcher.forced_tokens()[: min(limit, MAX_DRAFT_LEN)]
            if forced:
                return Draft(tuple(forced), "grammar")
        k = state.draft_len(min(limit, MAX_DRAFT_LEN))
        if k == 0:
            state.hits *= IDLE_DECAY
            state.misses *= IDLE_DECAY
            return None
        draft = self._follow(state, ids, k, req) or self._find(state, ids, k, req)
        if draft is not None and matcher is not None:  # only what the grammar allows
            draft = Draft(draft.tokens[: matcher.valid_prefix_len(draft.tokens)], draft.source)
        return draft if draft is not None and draft.tokens else None

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
