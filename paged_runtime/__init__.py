"""paged-runtime: a vLLM-class LLM serving runtime (paged KV cache, continuous batching).

The public names load on first use (module ``__getattr__``), so importing a
torch-free part such as ``paged_runtime.core.block_pool`` or the Ray ingress
does not pay for torch and the model code.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "paged_runtime.entrypoints.llm",
    "AsyncEngine": "paged_runtime.engine.async_engine",
    "EngineClient": "paged_runtime.engine.client",
    "SamplingParams": "paged_runtime.sampling_params",
    "StructuredOutputsParams": "paged_runtime.sampling_params",
    "ParameterError": "paged_runtime.sampling_params",
    "BeamSearchParams": "paged_runtime.engine.beam_search",
    "BeamSearchOutput": "paged_runtime.engine.beam_search",
    "EngineConfig": "paged_runtime.config",
    "RequestOutput": "paged_runtime.outputs",
    "CompletionOutput": "paged_runtime.outputs",
    "PoolingParams": "paged_runtime.pooling_params",
    "EmbeddingRequestOutput": "paged_runtime.outputs",
    "LoRARequest": "paged_runtime.lora.request",
}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from paged_runtime.config import EngineConfig
    from paged_runtime.engine.async_engine import AsyncEngine
    from paged_runtime.engine.beam_search import BeamSearchOutput, BeamSearchParams
    from paged_runtime.engine.client import EngineClient
    from paged_runtime.entrypoints.llm import LLM
    from paged_runtime.lora.request import LoRARequest
    from paged_runtime.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from paged_runtime.pooling_params import PoolingParams
    from paged_runtime.sampling_params import ParameterError, SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
