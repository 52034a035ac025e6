"""An eviction policy that learns online which order to follow: LeCaR's regret weights over
LRU and a second expert that learns what a node of each conversation level is worth.

The second expert, `LearnedOffsets`, is turn-credit (cache/eviction.py) with a learned offset
per level (min(8, turn - 1 + had a hit)) instead of a credit tuned on one trace, learned from
the mistakes the cache makes, as ARC learns its recency/frequency balance from its ghost lists:

- each evicted node leaves a *ghost* in the tree's one record of evicted edges (cache/turns.py:
  its namespace, where its edge starts, its first tokens, when it left; a bounded FIFO holding
  no KV), and with it this policy's memo, `Eviction`: the node's level and which expert chose
  it;
- a new leaf that starts where a ghost's edge started, with the ghost's tokens, within
  `window` cache lifetimes after the eviction (`lifetime`: how long a node stays after its
  last use), is that node coming back where a somewhat longer stay would have kept it: a
  mistake;
- every `epoch` evictions each level's offset moves by its measured return rate (mistakes per
  eviction, decayed) against the rate of all levels: a level whose evicted nodes come back
  more often than the rest stays longer, one whose nodes come back less (a conversation's
  last turn, an agent's finished loop) goes sooner. priority = last access + offset x
  lifetime, frozen at each touch and never lowered, as the lazy heap needs.

Offsets learned from return rates can still order a workload worse than plain recency (a
level that mixes nodes that come back with nodes that never do), so `AdaptivePolicy` does not
trust them blindly: as LeCaR does, each eviction follows one expert, LRU or the learned
offsets, drawn by weight; a ghost remembers which expert evicted it, and its return costs
that expert weight (x e^-0.45). The tree keeps one heap per expert (EvictionOrder). A workload
where recency is right ends up on LRU; one where levels matter, on the offsets. A return counts
once (the record hands a memo back once) and only in the namespace of the eviction.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, NamedTuple, cast

from radixlm.cache.eviction import LRUPolicy

if TYPE_CHECKING:
    from radixlm.cache.tree_node import TreeNode

DECAY = 0.9  # of the per-level counts at each update: they follow the recent mix
SHARE_DECAY = 1 / 256  # of each expert's eviction count, per eviction
MIN_EVICTIONS = 8.0  # (decayed) evictions of a level before its rate is trusted


class LearnedOffsets:
    """Per-level offsets learned online from ghost hits (see the module): the second expert."""

    name = "learned-offsets"

    def __init__(
        self,
        rate: float = 0.5,
        max_offset: float = 8.0,
        max_level: int = 8,
        window: float = 2.0,
        epoch: int = 256,
    ) -> None:
        if rate <= 0 or max_offset < 0 or max_level < 0 or epoch < 1:
            raise ValueError("rate > 0, max_offset >= 0, max_level >= 0, epoch >= 1")
        self.rate = rate
        self.max_offset = max_offset
        self.max_level = max_level
        self.window = window  # lifetimes after its eviction in which a return is a mistake
        self.epoch = epoch  # evictions between two updates of the offsets
        self.offsets = [0.0] * (max_level + 1)  # in lifetimes; all equal: LRU
        self.lifetime = 0.0  # ticks a node stays after its last use (a running mean)
        self._evictions = [0.0] * (max_level + 1)  # decayed, per level
        self._returns = [0.0] * (max_level + 1)  # decayed ghost hits, per level
        self._until_update = epoch

    def level(self, node: TreeNode) -> int:
        return max(0, min(self.max_level, node.turn - 1 + (node.hits > 0)))

    def priority(self, node: TreeNode) -> int:
        return node.priority

    def touch(self, node: TreeNode, tick: int) -> None:
        value = max(1, tick + int(self.offsets[self.level(node)] * self.lifetime))
        if value > node.priority:
            node.priority = value

    def evicted(self, node: TreeNode, tick: int) -> int:
        """Returns its memo: the node's level."""
        level = self.level(node)
        self.lifetime += (tick - node.last_access - self.lifetime) / 64
        self._evictions[level] += 1
        self._until_update -= 1
        if self._until_update <= 0:
            self._update()
        return level

    def returned(self, memo: object, evicted_tick: int, tick: int) -> None:
        """A node of level `memo` came back: a mistake when within `window` lifetimes."""
        if tick - evicted_tick <= self.window * self.lifetime:
            self._returns[cast(int, memo)] += 1

    def _update(self) -> None:
        """Move each trusted level's offset by its return rate against all levels'."""
        self._until_update = self.epoch
        total = sum(self._evictions)
        mean = sum(self._returns) / total if total else 0.0
        if mean > 0:
            for level, evictions in enumerate(self._evictions):
                if evictions >= MIN_EVICTIONS:
                    step = self.rate * (self._returns[level] / evictions - mean) / mean
                    offset = self.offsets[level] + max(-1.0, min(1.0, step))
                    self.offsets[level] = max(-self.max_offset, min(self.max_offset, offset))
        self._evictions = [e * DECAY for e in self._evictions]
        self._returns = [r * DECAY for r in self._returns]


class Eviction(NamedTuple):
    """AdaptivePolicy's memo of one eviction (kept with its ghost, cache/turns.py)."""

    expert: int  # the expert the pop followed: 0 LRU, 1 the learned offsets
    level: int  # LearnedOffsets.level of the node


class AdaptivePolicy:
    """LeCaR over LRU and LearnedOffsets (see the module). Each pop follows the expert that
    `choose()` drew; `priority` is that expert's (the order the tree's check reads)."""

    name = "adaptive"

    def __init__(
        self, penalty: float = 0.2, floor: float = 0.001, seed: int = 0, **offsets: float
    ) -> None:
        if penalty <= 0 or not 0 < floor < 0.5:
            raise ValueError("penalty must be > 0 and floor in (0, 0.5)")
        self.lru = LRUPolicy()
        self.learned = LearnedOffsets(**offsets)  # type: ignore[arg-type]
        self.experts = (self.lru, self.learned)
        self.weights = [0.5, 0.5]
        self.penalty = penalty
        self.floor = floor
        self._rng = random.Random(seed)  # the same trace makes the same choices
        self._chosen = 0  # the expert the current pop follows
        self._evictions = [1.0, 1.0]  # decayed, per expert

    def choose(self) -> int:
        self._chosen = 0 if self._rng.random() < self.weights[0] else 1
        return self._chosen

    def priority(self, node: TreeNode) -> int:
        return self.experts[self._chosen].priority(node)

    def touch(self, node: TreeNode, tick: int) -> None:
        self.learned.touch(node, tick)

    def evicted(self, node: TreeNode, tick: int) -> Eviction:
        level = self.learned.evicted(node, tick)
        self._evictions = [e * (1 - SHARE_DECAY) for e in self._evictions]
        self._evictions[self._chosen] += 1
        return Eviction(self._chosen, level)

    def returned(self, memo: object, evicted_tick: int, tick: int) -> None:
        """A node came back: the expert whose eviction made it a miss pays (within `window`
        lifetimes), and the learned offsets count the return of its level."""
        eviction = cast(Eviction, memo)
        learned = self.learned
        if tick - evicted_tick <= learned.window * learned.lifetime:
            self._regret(eviction.expert)
        learned.returned(eviction.level, evicted_tick, tick)

    def _regret(self, expert: int) -> None:
        """`expert` evicted a node that came back: it loses weight (never all of it), in
        proportion to how few of the recent evictions were its own, so the expert that makes
        fewer mistakes per eviction gains weight whatever its share."""
        share = self._evictions[expert] / (self._evictions[0] + self._evictions[1])
        w = self.weights
        w[expert] *= math.exp(-self.penalty * min(10.0, 0.5 / share))
        w[0] = min(1 - self.floor, max(self.floor, w[0] / (w[0] + w[1])))
        w[1] = 1.0 - w[0]
