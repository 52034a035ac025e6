"""A workload's prompts in one of three formats, for `radixlm bench serve --prompt-format`:

    tokens   token ids to /v1/completions (the workload as generated; what the engine sees)
    text     a string to /v1/completions: each token id becomes a word
    chat     messages to /v1/chat/completions: a root's part shared with other roots (a group's
             system prompt) is the system message, the rest the user message

Gateways that route on request text (smg's cache_aware) reject token-id prompts, so text and
chat are what goes through them. A follow-up request extends its parent by what the parent
actually returned: its text (text), or an assistant message with that text and a new user
message (chat); a server's re-tokenization of that text decides how much of it is a cache hit.

Words are drawn from a fixed list of common English words (one or two BPE tokens each with a
leading space), so the rendering is deterministic and prefix-preserving: the text of a prefix of
ids is a prefix of the text.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

from radixlm.bench.workloads import Workload, WorkloadProgress, WorkloadRequest

PromptFormat = Literal["tokens", "text", "chat"]
PROMPT_FORMATS: tuple[PromptFormat, ...] = ("tokens", "text", "chat")
Prompt = list[int] | str | list[dict[str, str]]

_WORDS = """the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her she there one all we their has been would when who will
    more if no out so said what up its about into than them can only other new some could time
    these two may then do first any my now such like our over man me even most made after also
    did many before must through back years where much your way well down should because each
    just those people how too little state good very make world still own see men work long get
    here between both life being under never day same another know while last might us great
    old year off come since against go came right used take three small place put home read
    hand large high even land city order line part number water sound light river word tree
    stone field music story paper table window garden market letter morning evening winter
    summer spring island forest valley mountain ocean bridge castle engine signal station
    planet silver golden quiet bright simple careful gentle rapid distant ancient modern
    common early final green yellow purple orange copper marble cotton"""
WORDS = tuple(dict.fromkeys(_WORDS.split()))


def render_words(ids: tuple[int, ...] | list[int]) -> str:
    """Each id as ' word' (a leading space, so concatenations stay word-separated)."""
    return "".join(" " + WORDS[t % len(WORDS)] for t in ids)


class PromptBook:
    """The prompts of one run: which a request sends, given what its parent returned.

    book = PromptBook(workload, "chat")
    book.prompt(i)                          # once request i's parent has finished
    book.finish(i, output_text, output_ids)
    book.group[i]                           # the root group request i belongs to
    """

    def __init__(self, workload: Workload, prompt_format: PromptFormat) -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got {prompt_format}")
        self.workload = workload
        self.format = prompt_format
        self.progress = WorkloadProgress(workload)  # the token-id view (tokens format, ideal)
        self.shared_len, self.group = _root_groups(workload)
        self._prompts: dict[int, Prompt] = {}
        self._outputs: dict[int, str] = {}

    def prompt(self, index: int) -> Prompt:
        """Request `index`'s prompt; raises ValueError while its parent is unfinished."""
        if self.format == "tokens":
            return self.progress.prompt(index)
        if index in self._prompts:
            return self._prompts[index]
        request = self.workload.requests[index]
        if request.parent is None:
            prompt = self._root(index)
        elif request.parent not in self._outputs:
            raise ValueError(f"request {index} waits for request {request.parent} to finish")
        else:
            prompt = self._followup(index, request.parent)
        self._prompts[index] = prompt
        return prompt

    def finish(self, index: int, output_text: str, output_ids: list[int]) -> None:
        """Record what request `index` returned; its children may be prompted now."""
        if self.format == "tokens":
            self.progress.finish(index, output_ids)
        else:
            self._outputs[index] = output_text

    # ---- helpers ----------------------------------------------------------------------------
    def _root(self, index: int) -> Prompt:
        new = self.workload.requests[index].new_tokens
        if self.format == "text":
            return render_words(new)
        shared = self.shared_len[index]
        user = render_words(new[shared:]).lstrip()
        if 0 < shared < len(new):
            system = render_words(new[:shared]).lstrip()
            return [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return [{"role": "user", "content": render_words(new).lstrip()}]

    def _followup(self, index: int, parent: int) -> Prompt:
        new = render_words(self.workload.requests[index].new_tokens)
        before, output = self._prompts[parent], self._outputs[parent]
        if isinstance(before, str):
            return before + output + new
        assert isinstance(before, list)
        turn = [{"role": "assistant", "content": output}, {"role": "user", "content": new.lstrip()}]
        return [*before, *turn]


def _root_groups(workload: Workload) -> tuple[list[int], list[int]]:
    """Per request: the length of its root's prefix shared with another root, and its group
    (roots sharing that prefix form one group; a follow-up belongs to its root's group)."""
    requests = workload.requests
    roots = [i for i, r in enumerate(requests) if r.parent is None]
    ordered = sorted(roots, key=lambda i: requests[i].new_tokens)
    shared = dict.fromkeys(roots, 0)
    for a, b in itertools.pairwise(ordered):  # the longest common prefix is with a sort neighbour
        n = _common_prefix_len(requests[a].new_tokens, requests[b].new_tokens)
        shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
    keys: dict[tuple[int, ...], int] = {}
    shared_len, group = [0] * len(requests), [0] * len(requests)
    for i, request in enumerate(requests):
        root = i if request.parent is None else _root_of(requests, i)
        shared_len[i] = shared[root]
        key = requests[root].new_tokens[: shared[root]] if shared[root] else (-1 - root,)
        group[i] = keys.setdefault(key, len(keys))
    return shared_len, group


def _root_of(requests: Sequence[WorkloadRequest], index: int) -> int:
    parent = requests[index].parent
    while parent is not None:  # parents come before their children: this ends
        index, parent = parent, requests[parent].parent
    return index


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
