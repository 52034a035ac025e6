"""Requests replayed through a radix tree without a model: what `radixlm lint` and the tests run.

Each OpenAI chat body is rendered to prompt ids exactly as the server renders it (the same
`PromptRenderer`, tools sorted, remembered assistant turns spliced), explained against the tree,
then inserted with its answer, the way the engine leaves prompt + output in the tree when a
request finishes. A body's answer is its "response" field (an OpenAI response or just a
message): a server log that kept it replays the server's tree. Without `capacity` nothing is
evicted; with it, least recently used leaves go once the tree holds more tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from radixlm.agents.prompt import PromptRenderer, TurnMemo
from radixlm.agents.tools import parse_tools
from radixlm.cache.radix_tree import RadixTree
from radixlm.observatory.explain import CacheReport, explain, text_decoder
from radixlm.observatory.probe import probe_tree
from radixlm.observatory.salts import PromptIndex
from radixlm.observatory.segments import chat_segments
from radixlm.tokenizer import Tokenizer


class PromptReplay:
    """A tree (its record of evicted edges included), the prompts' index and a turn memo, fed
    one chat body at a time. Every `cache_salt` of the bodies is one tenant's (the salt check
    compares them), as for a server whose requests all carry one key."""

    def __init__(self, tokenizer: Tokenizer, capacity: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.tree = RadixTree()
        self.prompts = PromptIndex()
        self.memo = TurnMemo()
        self.renderer = PromptRenderer(tokenizer, self.memo)
        self.decode = text_decoder(tokenizer.hf_tokenizer)
        self._next_slot = 0

    def request(self, body: Mapping[str, Any]) -> CacheReport:
        """Explain `body` against the tree, then cache its prompt and answer. Raises ValueError
        for a body the server would refuse (bad messages or tools)."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ValueError("a chat body needs a list of messages")
        tools = parse_tools(body.get("tools"))
        namespace = body.get("cache_salt")
        ids = self.renderer.prompt_ids(messages, tools, namespace)
        segments = chat_segments(self.renderer, messages, tools)
        others = self.prompts.others(ids, namespace)
        probe = probe_tree(self.tree, ids, namespace, others)
        self.prompts.record(ids, namespace)
        report = explain(probe, ids, self.decode, segments)
        answer = _answer(body.get("response"))
        output: list[int] = []
        if answer is not None:
            output = self.tokenizer.encode(answer, add_special_tokens=False)
            self.memo.remember(namespace, answer, (), output)
        self._insert(ids + output, namespace)
        return report

    def _insert(self, ids: list[int], namespace: str | None) -> None:
        slots = np.arange(self._next_slot, self._next_slot + len(ids), dtype=np.int64)
        self._next_slot += len(ids)  # slots are labels here: no pool behind them
        self.tree.insert(ids, slots, namespace)
        if self.capacity is not None and self.tree.num_tokens > self.capacity:
            self.tree.evict(self.tree.num_tokens - self.capacity)


def _answer(response: object) -> str | None:
    """The assistant's text from an OpenAI chat response, a message, or a string."""
    if isinstance(response, str):
        return response
    if not isinstance(response, Mapping):
        return None
    if isinstance(response.get("choices"), list) and response["choices"]:
        choice = response["choices"][0]
        response = choice.get("message") if isinstance(choice, Mapping) else None
        if not isinstance(response, Mapping):
            return None
    content = response.get("content")
    return content if isinstance(content, str) else None
