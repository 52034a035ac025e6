"""The server's observatory: a cache report for a request that asks, the misses' ring and
counters, and the eviction record hooked into the engine's tree.

    observatory = Observatory.attach(engine, metrics)      # once, when the app is built
    report = await observatory.explain_chat(...)           # only for return_cache_report
    observatory.misses.summary()                           # GET /v1/cache/report

The tree is read in the engine thread (`AsyncEngine.call`, between two steps, like /v1/cache);
rendering segments and decoding text run on a worker thread, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from radixlm.agents.prompt import PromptRenderer
from radixlm.agents.tools import ToolSpec
from radixlm.engine.async_engine import AsyncEngine
from radixlm.engine.engine import Engine
from radixlm.observatory.evictions import EvictionLog
from radixlm.observatory.explain import CacheReport, explain, text_decoder
from radixlm.observatory.probe import TreeProbe, probe_tree
from radixlm.observatory.report import MissLog
from radixlm.observatory.segments import chat_segments
from radixlm.observatory.tree_view import tree_picture

log = logging.getLogger(__name__)


class MissCounter(Protocol):
    """Where explained requests are counted by reason (the server's Prometheus metrics)."""

    def observe_cache_report(self, reason: str, lost_tokens: int) -> None: ...


class Observatory:
    def __init__(
        self, engine: AsyncEngine, counter: MissCounter | None = None, show_text: bool = False
    ) -> None:
        self.engine = engine
        self.counter = counter
        self.show_text = show_text  # the tree picture carries token text (prompts are private)
        self.evictions = EvictionLog()
        self.misses = MissLog()
        self.decode = text_decoder(engine.tokenizer.hf_tokenizer)

    @classmethod
    def attach(
        cls, engine: AsyncEngine, counter: MissCounter | None = None, show_text: bool = False
    ) -> Observatory:
        """An observatory whose eviction record listens to the engine's tree (a cache without
        a tree, the ablation's, has nothing to record or explain)."""
        observatory = cls(engine, counter, show_text)
        tree = getattr(engine.engine.cache, "tree", None)
        if tree is not None:
            tree.eviction_listener = observatory.evictions.record
        return observatory

    async def explain_chat(
        self,
        prompt: Sequence[int],
        namespace: str | None,
        renderer: PromptRenderer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[ToolSpec],
    ) -> CacheReport | None:
        """The report of a chat prompt against the tree as it is now (None without a tree)."""
        probe = await self.engine.call(lambda e: self._probe(e, prompt, namespace))
        if probe is None:
            return None

        def analyse() -> CacheReport:
            segments = chat_segments(renderer, messages, tools)
            return explain(probe, prompt, self.decode, segments)

        try:
            report = await asyncio.to_thread(analyse)
        except Exception:  # a report is a diagnosis: it never fails the request it describes
            log.exception("cache report failed")
            return None
        self.misses.add(report)
        if self.counter is not None:
            self.counter.observe_cache_report(report.reason, report.lost_tokens)
        return report

    async def tree_picture(self, max_nodes: int) -> dict[str, Any]:
        """The tree as `tree_view.tree_picture` draws it (empty without a tree); token text
        decoded here, outside the engine thread, and only when `show_text` is on."""

        def take(engine: Engine) -> dict[str, Any]:
            tree = getattr(engine.cache, "tree", None)
            if tree is None:
                return {"num_nodes": 0, "num_tokens": 0, "nodes": []}
            return tree_picture(tree, max_nodes, with_tokens=self.show_text)

        picture = await self.engine.call(take)
        for node in picture["nodes"]:
            head = node.pop("head", None)
            if head is not None:
                node["text"] = self.decode(head)
        return picture

    def _probe(
        self, engine: Engine, prompt: Sequence[int], namespace: str | None
    ) -> TreeProbe | None:
        tree = getattr(engine.cache, "tree", None)
        if tree is None:
            return None
        return probe_tree(tree, list(prompt), namespace, self.evictions)
