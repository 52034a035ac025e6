"""TieredTree (cache/l2/tree.py) against a brute-force reference, without a model or disk.

Random inserts, loads, RAM evictions and L2 evictions run on a tree whose extent store keeps
each extent's tokens in memory. After every operation: both tiers' invariants (check_integrity),
the slot account (free + tree == capacity) and the extent account (free + held == extents); every
slot a match returns holds the token it was inserted for, every extent a load reads holds the
query's tokens at its position, and nothing longer than the longest inserted prefix is found.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.cache.l2.node import EXTENT_TOKENS, extents_of, l2_children
from radixlm.cache.l2.tree import TieredTree
from radixlm.cache.tree_node import TreeNode
from radixlm.cache.turns import TurnTracker

NUM_SLOTS = 700


class MemoryStore:
    """An extent store that remembers each extent's tokens (the KV an extent would hold)."""

    def __init__(self, worth: bool, num_extents: int) -> None:
        self.worth = worth
        self.num_extents = num_extents
        self.free = list(range(num_extents))
        self.tokens: dict[int, bytes] = {}
        self.staged: set[int] = set()  # extents written through whose KV is still to be copied
        self.eviction_writes = 0  # extents written as their node left RAM
        self.tree: TieredTree

    def worth_writing(self, node: TreeNode, turns: TurnTracker) -> bool:
        return self.worth

    @property
    def num_free_extents(self) -> int:
        return len(self.free)

    def write_node(self, node: TreeNode, first: int, count: int, staged: bool) -> np.ndarray:
        extents = [self.free.pop() for _ in range(min(count, len(self.free)))]
        self.eviction_writes += len(extents) if not staged else 0
        path = np.frombuffer(path_tokens(node), dtype=np.int64)
        for i, extent in enumerate(extents):
            at = (first + i) * EXTENT_TOKENS
            self.tokens[extent] = path[at : at + EXTENT_TOKENS].tobytes()
        if staged:
            self.staged.update(extents)
        return np.array(extents, dtype=np.int64)

    def settle(self, node: TreeNode) -> None:
        extents = extents_of(node)
        assert extents is not None and len(node.value), "settled after leaving RAM"
        self.staged.difference_update(extents.tolist())

    def free_extents(self, extents: np.ndarray) -> None:
        for extent in extents.tolist():
            del self.tokens[extent]
            self.staged.discard(extent)
            self.free.append(extent)


def path_tokens(node: TreeNode) -> bytes:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return b"".join(reversed(keys))


class Harness:
    def __init__(self, worth: bool, num_extents: int = 12) -> None:
        self.store = MemoryStore(worth, num_extents)
        self.tree = TieredTree(self.store)
        self.store.tree = self.tree
        self.free = set(range(NUM_SLOTS))
        self.token_of: dict[int, int] = {}  # slot -> the token whose KV it holds
        self.inserted: list[np.ndarray] = []

    def alloc(self, n: int) -> np.ndarray | None:
        if n > len(self.free):
            self.free.update(self.tree.evict(n - len(self.free)).slots.tolist())
        if n > len(self.free):
            return None
        return np.array([self.free.pop() for _ in range(n)], dtype=np.int64)

    def insert(self, seq: np.ndarray) -> None:
        slots = self.alloc(len(seq))
        if slots is None:
            return
        for slot, token in zip(slots.tolist(), seq.tolist(), strict=True):
            self.token_of[slot] = token
        res = self.tree.insert(seq, slots)
        self.free.update(slots[: res.prefix_len].tolist())  # already cached: not used
        self.inserted.append(seq)

    def finish(self, seq: np.ndarray) -> None:
        """A request for `seq` finishes: its path is written through."""
        m = self.tree.match(seq)
        self.tree.lock(m.node)
        self.tree.write_through(m.node)
        self.tree.unlock(m.node)

    def load(self, seq: np.ndarray) -> None:
        tm = self.tree.match_tiers(seq)
        length = tm.l1.length
        if tm.chain:
            for node in tm.chain:  # every extent on the chain holds the query's tokens
                extents = extents_of(node)
                assert extents is not None
                first = node.start // EXTENT_TOKENS
                for i, extent in enumerate(extents.tolist()):
                    at = (first + i) * EXTENT_TOKENS  # a tail extent ends with its node
                    held = seq[at : min(at + EXTENT_TOKENS, node.depth)].tobytes()
                    assert self.store.tokens[extent] == held
            self.tree.lock(tm.l1.node)
            self.tree.pin(tm.chain, True)
            slots = self.alloc(tm.end - length)
            self.tree.unlock(tm.l1.node)
            self.tree.pin(tm.chain, False)
            if slots is not None:
                for slot, token in zip(slots.tolist(), seq[length : tm.end].tolist(), strict=True):
                    self.token_of[slot] = token
                m = self.tree.promote(tm, tm.end, slots)
                assert m.length == tm.end and m.node.depth == tm.end
                length = m.length
        m = self.tree.match(seq)
        assert m.length >= length
        assert [self.token_of[s] for s in m.slots.tolist()] == seq[: m.length].tolist()
        longest = max((_common(seq, s) for s in self.inserted), default=0)
        assert m.length <= longest

    def check(self) -> None:
        self.tree.check_integrity()
        assert len(self.free) + self.tree.num_tokens == NUM_SLOTS
        assert len(self.store.free) + self.tree.num_l2_extents == self.store.num_extents
        for node in l2_only(self.tree):  # its slots were freed: no extent may wait for a copy
            extents = extents_of(node)
            assert extents is not None and not self.store.staged & set(extents.tolist())


def l2_only(tree: TieredTree) -> list[TreeNode]:
    out: list[TreeNode] = []
    stack = list(tree.roots().values())
    while stack:
        node = stack.pop()
        stack += [*node.children.values(), *l2_children(node).values()]
        out += l2_children(node).values()
    return out


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


# Sequences share prefixes: a base (one of three, or the sequence before: a conversation's next
# turn) continued by a few random runs.
sequences = st.lists(
    st.tuples(st.integers(0, 4), st.lists(st.tuples(st.integers(1, 150), st.integers(0, 2)),
                                          min_size=1, max_size=4)),
    min_size=2, max_size=8,
)  # fmt: skip
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 7)),
        st.tuples(st.just("load"), st.integers(0, 7)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("request"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(1, 400)),
        st.tuples(st.just("evict_l2"), st.integers(1, 6)),
    ),
    min_size=4,
    max_size=40,
)


def build(spec: list[tuple[int, list[tuple[int, int]]]]) -> list[np.ndarray]:
    bases = [np.full(70 + 30 * b, 10 + b, dtype=np.int64) for b in range(3)]
    out: list[np.ndarray] = []
    for base, runs in spec:
        head = out[-1] if base > 2 and out else bases[base % 3]
        parts = [head] + [20 + t + np.arange(n, dtype=np.int64) % 3 for n, t in runs]
        out.append(np.concatenate(parts))
    return out


@settings(max_examples=300, deadline=None)
@given(spec=sequences, script=ops, worth=st.booleans(), num_extents=st.integers(1, 12))
def test_both_tiers_keep_their_invariants_and_serve_only_the_right_tokens(
    spec: list[tuple[int, list[tuple[int, int]]]],
    script: list[tuple[str, int]],
    worth: bool,
    num_extents: int,
) -> None:
    seqs = build(spec)
    h = Harness(worth, num_extents)
    for op, arg in script:
        if op == "insert":
            h.insert(seqs[arg % len(seqs)])
        elif op == "load":
            h.load(seqs[arg % len(seqs)])
        elif op == "finish":
            h.finish(seqs[arg % len(seqs)])
        elif op == "request":  # as the engine runs one: load, compute the rest, finish
            seq = seqs[arg % len(seqs)]
            h.load(seq)
            h.check()
            h.insert(seq)
            h.finish(seq)
        elif op == "evict":
            h.free.update(h.tree.evict(arg).slots.tolist())
        else:
            h.tree.evict_l2(arg)
        h.check()
    h.free.update(h.tree.flush().slots.tolist())
    h.tree.flush_l2()
    h.check()
    assert h.tree.num_tokens == 0 and h.tree.num_l2_extents == 0


def test_a_conversation_leaves_ram_and_comes_back_whole() -> None:
    h = Harness(worth=True)
    turn2 = _two_turns(h)
    h.free.update(h.tree.flush().slots.tolist())
    h.check()
    assert h.tree.num_tokens == 0 and h.tree.num_l2_extents == 4  # 3 whole, then 192..250
    tm = h.tree.match_tiers(turn2)
    assert tm.l1.length == 0 and tm.end == 250  # the tail extent comes back too
    h.load(turn2)
    h.check()
    assert h.tree.match(turn2).length == 250


def test_a_node_that_gains_a_child_gives_up_its_tail_extent() -> None:
    h = Harness(worth=True)
    turn2 = _two_turns(h)
    h.finish(turn2)  # extents 0..2, and the tail extent 192..250
    assert h.tree.num_l2_extents == 4
    turn3 = np.concatenate([turn2, np.arange(2000, 2100, dtype=np.int64)])
    h.insert(turn3)  # the node ending at 250 has a child now: extent 3 belongs to it, whole
    h.check()
    assert h.tree.num_l2_extents == 3
    h.finish(turn3)  # extents 3, 4 (192..320) and the tail extent 320..350
    h.check()
    assert h.tree.num_l2_extents == 6
    h.free.update(h.tree.flush().slots.tolist())
    h.check()
    for seq, end in ((turn2, 192), (turn3, 350)):  # turn2 ends inside extent 3: 192 is whole
        assert h.tree.match_tiers(seq).end == end
    h.load(turn3)
    h.check()
    assert h.tree.match(turn3).length == 350


def test_a_longer_prompt_loads_a_tail_extent_and_computes_the_rest() -> None:
    h = Harness(worth=True)
    turn2 = _two_turns(h)
    h.free.update(h.tree.flush().slots.tolist())
    turn3 = np.concatenate([turn2, np.arange(3000, 3040, dtype=np.int64)])
    assert h.tree.peek_tiers(turn3) == 250 and h.tree.match_tiers(turn3).end == 250
    h.load(turn3)
    h.check()
    assert h.tree.match(turn3).length == 250
    h.insert(turn3)  # the computed rest: the loaded node gives up its tail extent
    h.check()
    assert h.tree.match(turn3).length == len(turn3) and h.tree.num_l2_extents == 3


A = np.arange(300, dtype=np.int64)
B = np.concatenate([A[:200], np.arange(5000, 5100, dtype=np.int64)])


def test_a_load_that_diverges_inside_an_l2_edge_ends_on_a_extent_boundary() -> None:
    h = Harness(worth=True)
    h.insert(A)
    h.free.update(h.tree.flush().slots.tolist())  # A -> extents 0..3 and the tail extent 256..300
    assert h.tree.num_l2_extents == 5
    h.load(B)  # shares 200 tokens with A: loads 192, the L2 node split there
    h.check()
    assert h.tree.match(B).length == 192 and h.tree.num_l2_nodes == 1


def test_an_insert_claims_the_l2_nodes_it_recomputed() -> None:
    h = Harness(worth=True)
    h.insert(A)
    h.free.update(h.tree.flush().slots.tolist())
    h.insert(B)  # computed without a load: A's L2 node is split at 200 and claimed up to it
    h.check()
    assert h.tree.match(B).length == len(B)
    assert h.tree.num_l2_extents == 5 and h.tree.num_l2_nodes == 1  # 200..300 stays on L2


def test_a_full_l2_keeps_the_head_of_a_chain() -> None:
    h = Harness(worth=True, num_extents=2)
    h.insert(A)
    h.insert(B)
    h.free.update(h.tree.flush().slots.tolist())
    h.check()
    assert h.tree.num_l2_extents == 2
    h.load(A)
    h.check()
    assert h.tree.match(A).length == 2 * EXTENT_TOKENS


def test_a_finished_path_is_written_through_and_leaves_ram_without_a_write() -> None:
    h = Harness(worth=True)
    turn2 = _two_turns(h)
    h.finish(turn2)
    h.check()
    assert h.tree.num_l2_extents == 4 and len(h.store.staged) == 4  # none copied yet
    assert h.tree.num_tokens == 250  # still in RAM as well
    h.free.update(h.tree.flush().slots.tolist())
    h.check()  # every extent was settled before its slots were freed
    assert h.store.eviction_writes == 0 and not h.store.staged and h.tree.num_l2_extents == 4
    h.load(turn2)
    assert h.tree.match(turn2).length == 250


def test_a_finish_writes_through_while_l2_has_room_then_only_what_the_filter_wants() -> None:
    """The pressure rule at a finish: room for the whole path, it is written whatever the
    filter says; no room (300 tokens: 4 whole extents and a tail, 2 free), the filter decides."""
    h = Harness(worth=False, num_extents=8)
    h.insert(A)
    h.finish(A)
    h.check()
    assert h.tree.num_l2_extents == 5 and h.store.eviction_writes == 0
    h = Harness(worth=False, num_extents=2)
    h.insert(A)
    h.finish(A)
    h.check()
    assert h.tree.num_l2_extents == 0


def test_a_finish_into_a_full_l2_writes_the_head_and_splits_there() -> None:
    h = Harness(worth=True, num_extents=2)
    h.insert(A)
    h.finish(A)  # 4 extents end in A's edge, 2 fit: the node is split after them
    h.check()
    assert h.tree.num_l2_extents == 2 and h.tree.num_nodes == 2
    h.free.update(h.tree.flush().slots.tolist())
    h.check()
    assert h.store.eviction_writes == 0  # the tail found no room either: it is dropped
    h.load(A)
    assert h.tree.match(A).length == 2 * EXTENT_TOKENS


def test_l2_drops_a_copy_of_ram_before_a_node_that_just_left_ram() -> None:
    h = Harness(worth=True, num_extents=6)
    old = np.arange(3 * EXTENT_TOKENS, dtype=np.int64)
    young = np.arange(7000, 7000 + 3 * EXTENT_TOKENS, dtype=np.int64)
    for seq in (old, young):
        h.insert(seq)
        h.finish(seq)  # both written through: 6 extents, L2 is full
    h.tree.match(np.arange(9000, 9064, dtype=np.int64))  # time passes (a miss)
    h.free.update(h.tree.evict(len(old)).slots.tolist())  # RAM lets the older one go
    h.insert(np.arange(8000, 8000 + EXTENT_TOKENS, dtype=np.int64))
    h.finish(np.arange(8000, 8000 + EXTENT_TOKENS, dtype=np.int64))  # needs an extent
    h.check()
    # `young` was used after `old`, but it is still in RAM: its copy goes, not `old`'s extents
    assert h.tree.peek_tiers(old) == len(old) and h.tree.peek(old) == 0
    assert h.tree.peek(young) == len(young) and h.tree.num_l2_extents == 4


def _two_turns(h: Harness) -> np.ndarray:
    """A conversation's two turns inserted into `h` (100 tokens, then 150 more): the second."""
    turn1 = np.arange(100, dtype=np.int64)
    turn2 = np.concatenate([turn1, np.arange(1000, 1150, dtype=np.int64)])
    h.insert(turn1)
    h.insert(turn2)
    return turn2
