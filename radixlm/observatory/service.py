"""The server's observatory: a cache report for a request that asks, the misses' ring and
counters, the prompts' index for the salt check, and the eviction record hooked into the tree.

    observatory = Observatory.attach(engine, metrics)      # once, when the app is built
    task = observatory.report_soon(prompt, ns, segments)   # only for return_cache_report,
    ...submit the request...                               #   before the request is submitted
    observatory.note(prompts, ns)                          # every admitted request
    report = await task
    observatory.misses.summary()                           # GET /v1/cache/report

The tree is read in the engine thread (`AsyncEngine.call`). The probe is queued before the
request it explains, so both run in the same pause between two steps, probe first: the probe
sees the tree the request finds, and the request waits for no extra step. Rendering segments and
decoding text run on a worker thread while the request runs, so neither the event loop nor the
request's admission waits for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from radixlm.cache.tree_node import Namespace
from radixlm.engine.async_engine import AsyncEngine
from radixlm.engine.engine import Engine
from radixlm.observatory.evictions import EvictionLog
from radixlm.observatory.explain import CacheReport, explain, text_decoder
from radixlm.observatory.probe import TreeProbe, probe_tree
from radixlm.observatory.report import MissLog
from radixlm.observatory.salts import PromptIndex
from radixlm.observatory.segments import SegmentMap
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
        self.prompts = PromptIndex()  # written and read on the event loop only
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

    def report_soon(
        self,
        prompt: Sequence[int],
        namespace: Namespace,
        segments: Callable[[], SegmentMap] | None = None,
    ) -> asyncio.Task[CacheReport | None]:
        """Start the report of `prompt` (None without a tree). Call it before submitting the
        request: its probe is queued to the engine thread first (see the module docstring).
        `segments` renders the chat map (on the worker thread); None for a plain prompt."""
        others = self.prompts.others(prompt, namespace)
        probe = asyncio.ensure_future(
            self.engine.call(lambda e: self._probe(e, prompt, namespace, others))
        )
        return asyncio.ensure_future(self._explain(probe, prompt, segments))

    def note(self, prompts: Sequence[Sequence[int]], namespace: Namespace) -> None:
        """Record admitted prompts in the salt check's index (every request; O(log n) each)."""
        for prompt in prompts:
            self.prompts.record(prompt, namespace)

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

    async def _explain(
        self,
        probe: asyncio.Future[TreeProbe | None],
        prompt: Sequence[int],
        segments: Callable[[], SegmentMap] | None,
    ) -> CacheReport | None:
        taken = await probe
        if taken is None:
            return None

        def analyse() -> CacheReport:
            return explain(taken, prompt, self.decode, segments() if segments else None)

        try:
            report = await asyncio.to_thread(analyse)
        except Exception:  # a report is a diagnosis: it never fails the request it describes
            log.exception("cache report failed")
            return None
        self.misses.add(report)
        if self.counter is not None:
            self.counter.observe_cache_report(report.reason, report.lost_tokens)
        return report

    def _probe(
        self, engine: Engine, prompt: Sequence[int], namespace: Namespace, others: list[Namespace]
    ) -> TreeProbe | None:
        tree = getattr(engine.cache, "tree", None)
        if tree is None:
            return None
        return probe_tree(tree, list(prompt), namespace, self.evictions, others)
