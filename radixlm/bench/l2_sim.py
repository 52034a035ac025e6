"""The L2 (disk) tier as `bench cache` simulates it: which tokens it holds, hits, bytes moved.

L1 is the replayed RadixTree. As the served tier does (cache/l2/tree.py), a finished request's
path is written through down to its deepest node *likely to come back* (the write filter of
cache/l2/store.py: a node that had a hit, a conversation's second turn or later, or a first turn
when at least `write_rate` of first turns have come back so far), and a node L1 evicts is
written then, by `write_rule`, if it was not yet, and aged from then. L2 is a second tree over
the same tokens with its own capacity and leaf-first LRU eviction. A request whose L1 match
stops early and whose prompt continues in L2 reads that continuation back: those tokens are L2
hits (loaded, not recomputed). Writing a node writes the part of its path that L2 does not hold
yet, so L2 stays prefix-closed, as the served tier must be to be useful.

What RAM evicts is written by `write_rule`: `pressure` (the default, and the served tier's rule:
cache/l2/store.py's `pressure_wants`) writes everything while the tier has room for it and
asks the filter only once it is full (a filter that refuses writes to a tier with free space
loses hits for nothing); `filter` asks the write filter always (one-shot traffic never reaches
the disk); `all` writes everything, evicting L2's least recently used leaves when full.
"""

from __future__ import annotations

import numpy as np

from radixlm.cache.radix_tree import RadixTree, TreeNode
from radixlm.cache.turns import TurnTracker

# bf16 KV bytes per token of the default model (SmolLM2-135M): 30 layers x (K, V) x 3 KV heads
# x head_dim 64 x 2 bytes.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2
WRITE_RULES = ("filter", "pressure", "all")


class L2Sim:
    """A simulated L2 tier of `capacity` tokens fed by an L1 tree's evictions."""

    def __init__(
        self,
        capacity: int,
        turns: TurnTracker,
        page_size: int = 1,
        write_rate: float = 0.25,
        write_rule: str = "pressure",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"l2 capacity must be >= 1, got {capacity}")
        if write_rule not in WRITE_RULES:
            raise ValueError(f"write_rule must be one of {WRITE_RULES}, got {write_rule!r}")
        self.capacity = capacity
        self.write_rule = write_rule
        self.turns = turns  # the L1 tree's: its measured return rates drive the write filter
        self.write_rate = write_rate
        self.tree = RadixTree(page_size=page_size, policy="lru")
        self._next_slot = 0
        self.written_tokens = 0
        self.read_tokens = 0
        self.rejected_tokens = 0  # evicted from L1 but not worth writing
        self.evicted_tokens = 0

    def worth_writing(self, node: TreeNode) -> bool:
        """Worth a disk write: likely to be read back (see the module)."""
        if node.turn >= 2 or node.hits > 0:
            return True
        rate = self.turns.return_rate(node.turn)
        return rate is not None and rate >= self.write_rate

    def on_finish(self, node: TreeNode) -> None:
        """A request ending at `node` finished: write its path down to the deepest node worth
        keeping (TieredTree.write_through, cache/l2/tree.py)."""
        while node.parent is not None and not self.worth_writing(node):
            node = node.parent
        if node.parent is not None:
            self._write(_path_tokens(node))

    def on_l1_evict(self, node: TreeNode) -> None:
        """The L1 tree's eviction listener: write what L2 lacks of `node`'s path (nothing if it
        was written through) and touch it: its L2 age starts when it leaves RAM."""
        rule = self.write_rule
        room = self.tree.num_tokens + len(node.value) <= self.capacity
        if rule == "filter" or (rule == "pressure" and not room):
            wanted = self.worth_writing(node)
        else:
            wanted = True
        if not wanted:
            self.rejected_tokens += len(node.value)
            return
        self._write(_path_tokens(node))

    def _write(self, path: np.ndarray) -> None:
        slots = np.arange(self._next_slot, self._next_slot + len(path), dtype=np.int64)
        self._next_slot += len(path)
        present = self.tree.insert(path, slots).prefix_len
        self.written_tokens += len(path) // self.tree.page_size * self.tree.page_size - present
        over = self.tree.num_tokens - self.capacity
        if over > 0:
            self.evicted_tokens += self.tree.evict(over).num_tokens

    def load(self, prompt: np.ndarray, l1_hit: int) -> int:
        """Tokens of `prompt` after its L1 hit of `l1_hit` that L2 holds (read back)."""
        l2_len = self.tree.match(prompt).length
        extra = max(0, l2_len - l1_hit)
        self.read_tokens += extra
        return extra


def _path_tokens(node: TreeNode) -> np.ndarray:
    """The token ids from the root down to the end of `node`."""
    keys: list[bytes] = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return np.frombuffer(b"".join(reversed(keys)), dtype=np.int64)
