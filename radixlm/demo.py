"""`radixlm demo`: a small chat scenario replayed through the prefix cache, printed with rich.

Until the engine exists this is what `make run` shows: each request walks the radix tree,
reuses the KV slots of its longest cached prefix, computes the rest, and leaves its prompt and
answer in the tree. Tokens are words (a toy tokenizer), so every edge reads as text.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from rich.table import Table
    from rich.tree import Tree

    from radixlm.cache.prefix_cache import RadixCache

SYSTEM = "You are a careful coding assistant. Answer briefly and show code when it helps."
REPO = "Repository: a Python web service with app.py models.py auth.py and db.py ."
AUTH = "auth.py: def login(user, password): token = make_token(user) ; return token"
DB = "db.py: def orders(customer): return query('SELECT * FROM orders WHERE id = ?', customer)"
SCENARIO = [  # (prompt parts, the answer the model "generated")
    ((SYSTEM, REPO, AUTH, "Fix this bug: login never checks the password ."), "Check it first ."),
    ((SYSTEM, REPO, AUTH, "Add OAuth login with GitHub ."), "Use an OAuth client ."),
    ((SYSTEM, REPO, DB, "Optimize this query ."), "Add an index on customer ."),
]


class Step(NamedTuple):
    question: str
    prompt_len: int
    reused: int
    computed: int
    splits: list[int]  # token positions where an edge was split
    tokens: list[int]  # prompt + answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-size", type=int, default=1, metavar="N")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from radixlm.cache.kv_pool import SlotAllocator
    from radixlm.cache.prefix_cache import RadixCache
    from radixlm.cache.radix_tree import RadixTree

    if args.page_size < 1:
        raise SystemExit("--page-size must be >= 1")
    cache = RadixCache(SlotAllocator(1024), RadixTree(page_size=args.page_size))
    vocab = Vocab()
    steps = [_serve(cache, vocab, parts, answer) for parts, answer in SCENARIO]
    console = Console()
    console.print(_steps_table(steps, vocab))
    console.print(_tree_view(cache, vocab))
    s = cache.stats()
    console.print(
        f"reused {s.hit_tokens} of {s.queried_tokens} prompt tokens; {s.num_nodes} nodes; "
        f"slots: {s.num_free} free + {cache.num_tree_tokens} in the tree + "
        f"{s.num_in_flight} in flight = {s.capacity}"
    )
    cache.check_integrity()
    return 0


class Vocab:
    """Word <-> id, growing as new words appear."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
        return [self.ids[w] for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def _serve(cache: RadixCache, vocab: Vocab, parts: tuple[str, ...], answer: str) -> Step:
    """One request through the cache as the engine will run it."""
    import numpy as np

    prompt = np.array(vocab.encode(" ".join(parts)), dtype=np.int64)
    splits_before = cache.tree.stats().num_splits
    m = cache.match(prompt[:-1])  # the last prompt token is always computed (its logits)
    splits = [m.length] if cache.tree.stats().num_splits > splits_before else []
    cache.lock(m.node)
    tokens = np.concatenate([prompt, vocab.encode(answer)]).astype(np.int64)
    slots = np.concatenate([m.slots, cache.alloc(len(tokens) - m.length)])
    splits_before = cache.tree.stats().num_splits
    done = cache.commit(tokens, slots, None, m.node)
    if cache.tree.stats().num_splits > splits_before:
        splits.append(done.node.depth - (done.cached_len - m.length))
    cache.release(done.node, done.slots[done.cached_len :])
    reused, computed = m.length, len(prompt) - m.length
    return Step(parts[-1], len(prompt), reused, computed, splits, tokens.tolist())


def _steps_table(steps: list[Step], vocab: Vocab) -> Table:
    from rich.table import Table

    table = Table(title="Requests through the radix cache", title_justify="left")
    for column in ("#", "last message", "prompt", "reused", "computed", "what happened"):
        table.add_column(column, justify="right" if column in ("prompt", "reused") else "left")
    for i, step in enumerate(steps, 1):
        note = "cold: nothing cached yet" if step.reused == 0 else "reused the cached prefix"
        for pos in step.splits:
            note += (
                f"; split an edge after token {pos} “… {vocab.decode(step.tokens[pos - 2 : pos])}”"
            )
        table.add_row(
            str(i), step.question, str(step.prompt_len), f"[green]{step.reused}[/]",
            f"[yellow]{step.computed}[/]", note,
        )  # fmt: skip
    return table


def _tree_view(cache: RadixCache, vocab: Vocab) -> Tree:
    """The final tree: one line per edge, its text abbreviated, its length and slots."""
    from rich.tree import Tree

    root = cache.tree.root()
    view = Tree("[bold]radix tree[/] (root)")
    stack = [(root, view)]
    while stack:
        node, branch = stack.pop()
        for child in sorted(node.children.values(), key=lambda c: int(c.tokens[0])):
            words = vocab.decode(child.tokens.tolist()).split()
            if len(words) > 8:
                words = [*words[:4], "…", *words[-2:]]
            slots = f"{len(child.value)} tokens, slots {child.value[0]}..{child.value[-1]}"
            label = f"[cyan]{' '.join(words)}[/]  [dim]{slots}[/]"
            stack.append((child, branch.add(label)))
    return view
