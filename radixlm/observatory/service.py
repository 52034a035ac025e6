"""The server's observatory: a cache report for a request that asks, the misses' rings and
counters, and the prompts' index for the salt check; all of it per tenant.

    observatory = Observatory(engine, metrics, tenant_of=...)  # once, when the app is built
    task = observatory.report_soon(prompt, ns, segments)   # only for return_cache_report,
    ...submit the request...                               #   before the request is submitted
    observatory.note(prompts, ns)                          # every queued request
    report = await task
    observatory.summary(viewer)                            # GET /v1/cache/report

Tenancy: `tenant_of(namespace)` names the tenant a namespace belongs to (the server's
`--salt-from`: a key, a header, or the salt itself). A report compares a prompt with its own
namespace, the evictions recorded there (cache/turns.py) and other namespaces of its own tenant
only; it goes to its tenant's ring; a `Viewer` reads one tenant's ring and tree, or, for the
operator, all of them. So nothing a tenant reads depends on another tenant's prompts.

The tree is read in the engine thread (`AsyncEngine.call`). The probe is queued before the
request it explains, so both run in the same pause between two steps, probe first: the probe
sees the tree the request finds, and the request waits for no extra step. Rendering segments and
decoding text run on a worker thread while the request runs, so neither the event loop nor the
request's queueing waits for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixlm.cache.tree_node import Namespace
from radixlm.engine.async_engine import AsyncEngine
from radixlm.engine.engine import Engine
from radixlm.observatory.explain import CacheReport, explain, text_decoder
from radixlm.observatory.probe import TreeProbe, probe_tree
from radixlm.observatory.report import MissRings
from radixlm.observatory.salts import PromptIndex, one_tenant
from radixlm.observatory.segments import SegmentMap
from radixlm.observatory.tree_view import tree_picture

log = logging.getLogger(__name__)


class MissCounter(Protocol):
    """Where explained requests are counted by reason (the server's Prometheus metrics)."""

    def observe_cache_report(self, reason: str, lost_tokens: int) -> None: ...


@dataclass(frozen=True)
class Viewer:
    """Who reads the observatory: one tenant (its own namespaces, its own ring) or the
    operator (everything)."""

    tenant: Hashable = None
    operator: bool = False


class Observatory:
    def __init__(
        self,
        engine: AsyncEngine,
        counter: MissCounter | None = None,
        show_text: bool = False,
        tenant_of: Callable[[Namespace], Hashable] = one_tenant,
    ) -> None:
        self.engine = engine
        self.counter = counter
        self.show_text = show_text  # the tree picture carries token text (prompts are private)
        self.tenant_of = tenant_of
        self.misses = MissRings()
        self.prompts = PromptIndex(tenant_of=tenant_of)  # written and read on the event loop
        self.decode = text_decoder(engine.tokenizer.hf_tokenizer)

    def report_soon(
        self,
        prompt: Sequence[int],
        namespace: Namespace,
        segments: Callable[[], SegmentMap] | None = None,
    ) -> asyncio.Task[CacheReport | None]:
        """Start the report of `prompt` (None without a tree). Call it before submitting the
        request: its probe is queued to the engine thread first (see the module docstring).
        `segments` renders the chat map (on the worker thread); None for a plain prompt."""
        others = self.prompts.others(prompt, namespace)  # namespaces of its own tenant
        probe = asyncio.ensure_future(
            self.engine.call(lambda e: self._probe(e, prompt, namespace, others))
        )
        return asyncio.ensure_future(self._explain(probe, prompt, namespace, segments))

    def note(self, prompts: Sequence[Sequence[int]], namespace: Namespace) -> None:
        """Record queued prompts in the salt check's index (every request; O(log n) each)."""
        for prompt in prompts:
            self.prompts.record(prompt, namespace)

    def summary(self, viewer: Viewer) -> dict[str, Any]:
        """The misses `viewer` may read: its tenant's ring, or all of them."""
        if viewer.operator:
            return self.misses.summary_all()
        return self.misses.summary(viewer.tenant)

    async def tree_picture(self, max_nodes: int, viewer: Viewer) -> dict[str, Any]:
        """The tree as `tree_view.tree_picture` draws it (empty without a tree), `viewer`'s
        namespaces only; token text decoded here, outside the engine thread, and only when
        `show_text` is on."""
        owns = None if viewer.operator else self._owner(viewer.tenant)

        def take(engine: Engine) -> dict[str, Any]:
            tree = getattr(engine.cache, "tree", None)
            if tree is None:
                return {"num_nodes": 0, "num_tokens": 0, "nodes": []}
            return tree_picture(tree, max_nodes, with_tokens=self.show_text, owns=owns)

        picture = await self.engine.call(take)
        for node in picture["nodes"]:
            head = node.pop("head", None)
            if head is not None:
                node["text"] = self.decode(head)
        return picture

    def _owner(self, tenant: Hashable) -> Callable[[Namespace], bool]:
        tenant_of = self.tenant_of
        return lambda namespace: tenant_of(namespace) == tenant

    async def _explain(
        self,
        probe: asyncio.Future[TreeProbe | None],
        prompt: Sequence[int],
        namespace: Namespace,
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
        self.misses.add(self.tenant_of(namespace), report)
        if self.counter is not None:
            self.counter.observe_cache_report(report.reason, report.lost_tokens)
        return report

    def _probe(
        self, engine: Engine, prompt: Sequence[int], namespace: Namespace, others: list[Namespace]
    ) -> TreeProbe | None:
        tree = getattr(engine.cache, "tree", None)
        if tree is None:
            return None
        return probe_tree(tree, list(prompt), namespace, others)
