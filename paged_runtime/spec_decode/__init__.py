"""Speculative decoding: proposers (n-gram, draft model) and the exact rejection sampler."""
from paged_runtime.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
