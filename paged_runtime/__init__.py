"""paged-runtime: a vLLM-class LLM serving runtime (paged KV cache, continuous batching)."""
from paged_runtime.config import EngineConfig
from paged_runtime.engine.async_engine import AsyncEngine
from paged_runtime.engine.beam_search import BeamSearchOutput, BeamSearchParams
from paged_runtime.entrypoints.llm import LLM
from paged_runtime.outputs import CompletionOutput, RequestOutput
from paged_runtime.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "EngineConfig", "RequestOutput", "CompletionOutput", "__version__"]
