"""radixlm: an LLM serving engine whose KV cache is a radix tree over token ids.

from radixlm import LLM, SamplingParams
LLM().generate("Hello", SamplingParams(temperature=0, max_tokens=32))[0].text
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixlm.api_types import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from radixlm.engine.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the model code; import it on first use, so that `radixlm --help`
    # and the cache-only tools stay light.
    if name == "LLM":
        from radixlm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
