"""Which other namespaces (cache salts) of the same tenant recently sent a prompt that begins
like this one, so the "salt" check peeks one or two namespaces instead of walking every root.

Every queued prompt is recorded (`PromptIndex.record`): a chained hash of its lookup key (all
but the last token, as the tree's) at a few boundaries, 16, 32, 64, ... tokens and the whole key,
each mapped to the namespaces that sent it, most recent first. A report looks its own prompt up
at the same boundaries, deepest first (`others`), and peeks only the namespaces found there:
the peek gives the exact length, so the boundaries only need to find the right namespace, and a
prompt that shares a prefix of n tokens with another is found at the boundary at or below n.

Rules: the index is per tenant (what the server's `--salt-from` derives: a key, a header, or the
salt itself): the tenant seeds every hash, so a lookup only ever finds namespaces of the
caller's own tenant, and a report never peeks at another tenant's prompts. The boundaries
double, so a record costs one pass over the prompt's ids and O(log n) dict writes, whatever the
number of namespaces; an entry is a hint (its KV may have been evicted since), never a proof; a
prefix shorter than the first boundary under another salt is not found (it holds at most 15
tokens). Touched only from the server's event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from radixlm.cache.tree_node import Namespace

FIRST_BOUNDARY = 16  # tokens; the boundaries are 16, 32, 64, ... and the whole lookup key
NAMESPACES_PER_KEY = 4  # the most recent namespaces kept for one prefix
MAX_OTHERS = 4  # namespaces a report peeks, at most


def one_tenant(namespace: Namespace) -> Hashable:
    """Every namespace belongs to one tenant (offline replay: one client's salts)."""
    return None


class PromptIndex:
    """Prefix hashes of recent prompts -> the namespaces that sent them (bounded, LRU), per
    tenant: `tenant_of(namespace)` names the tenant a namespace belongs to."""

    def __init__(
        self,
        capacity: int = 1 << 16,
        tenant_of: Callable[[Namespace], Hashable] = one_tenant,
    ) -> None:
        self.capacity = capacity
        self.tenant_of = tenant_of
        self._entries: OrderedDict[int, tuple[Namespace, ...]] = OrderedDict()

    def record(self, prompt: Sequence[int] | np.ndarray, namespace: Namespace) -> None:
        """Remember that `namespace` sent `prompt` (called once per queued prompt)."""
        entries = self._entries
        for key in _prefix_keys(prompt, self.tenant_of(namespace)):
            held = entries.get(key, ())
            if held[:1] != (namespace,):
                entries[key] = (namespace, *(n for n in held if n != namespace))[
                    :NAMESPACES_PER_KEY
                ]
            entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def others(self, prompt: Sequence[int] | np.ndarray, namespace: Namespace) -> list[Namespace]:
        """Namespaces of the same tenant, other than `namespace`, that sent a prompt sharing the
        longest recorded prefix with `prompt`, most recent first (at most MAX_OTHERS)."""
        tenant = self.tenant_of(namespace)
        for key in reversed(_prefix_keys(prompt, tenant)):
            # the tenant check again: a hash collision must not name another tenant's namespace
            held = self._entries.get(key, ())
            found = [n for n in held if n != namespace and self.tenant_of(n) == tenant]
            if found:
                return found[:MAX_OTHERS]
        return []

    def __len__(self) -> int:
        return len(self._entries)


def _prefix_keys(prompt: Sequence[int] | np.ndarray, tenant: Hashable) -> list[int]:
    """The chained hashes of the lookup key's prefixes at the boundaries, shortest first, in
    `tenant`'s own key space."""
    ids = prompt.tolist() if isinstance(prompt, np.ndarray) else prompt
    n = len(ids) - 1  # the lookup key: all but the last token
    ends, end = [], FIRST_BOUNDARY
    while end < n:
        ends.append(end)
        end *= 2
    if n > 0:
        ends.append(n)
    keys, start = [], 0
    state = hash(("tenant", tenant))
    for end in ends:
        # each step hashes only the ids since the last boundary (a tuple of ints hashes without
        # converting them to bytes): one pass in all
        state = hash((state, end, tuple(ids[start:end])))
        keys.append(state)
        start = end
    return keys
