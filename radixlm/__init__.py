"""radixlm: an LLM serving engine whose KV cache is a radix tree over token ids."""

from radixlm.request import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
