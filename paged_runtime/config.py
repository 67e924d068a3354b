"""Engine configuration: vLLM's argument names, validated once at start-up."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from paged_runtime.spec_decode.config import SpeculativeConfig


CACHE_ENV = "PAGED_RUNTIME_CACHE"
CPU_KERNELS_ENV = "PAGED_RUNTIME_CPU_KERNELS"
ATTENTION_BACKEND_ENV = "PAGED_RUNTIME_ATTENTION_BACKEND"
# vLLM has no caps; OpenAI allows 4 stop strings. 64 of up to 512 characters serve any real use and
# keep the per-token match (one pattern over a tail window of the longest string) small.
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_LENGTH = 512
# --quantization: weights quantized at load (layers/quantization.NAMES, repeated here to keep this module light)
QUANTIZATIONS = ("none", "int8", "int4", "fp8", "gguf", "gptq", "awq", "compressed-tensors")
# --kv-cache-dtype: the paged cache's elements (kernels/kv_quant.CACHE_DTYPES, repeated here to keep this light)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value in (None, "") else value != "0"


def default_cache_dir() -> Path:
    """``$PAGED_RUNTIME_CACHE`` or ``~/.cache/paged_runtime``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "paged_runtime"


@dataclass
class EngineConfig:
    model: str | None = None  # a Hugging Face folder, a .gguf file, or None for the embedded default
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"
    # As vLLM's --quantization: "int8" (W8A16, per output channel), "int4" (W4A16, groups of 128, asymmetric)
    # and "fp8" (W8A8 float8_e4m3fn) quantize at load; a quantized checkpoint's own format ("gguf": a .gguf's
    # blocks; "gptq", "awq", "compressed-tensors": config.json's quantization_config) is used by itself (None);
    # "none": plain weights (a .gguf dequantized at load).
    quantization: str | None = None
    # The paged KV cache's elements, as vLLM's --kv-cache-dtype: "auto" (the model's dtype), "fp8" / "fp8_e4m3"
    # (float8_e4m3fn, per-tensor scales 1.0), "int8" (per token and head scales): ~2x the tokens per byte.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a share of free memory
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    device: str = "auto"
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority": lower value first, then arrival
    served_model_name: str | None = None
    # Plain PyTorch everywhere: no CUDA graphs on the GPU, no compiled kernels on the CPU.
    enforce_eager: bool = False
    debug_checks: bool = False  # check block-accounting invariants after every step
    # Schedule step N + 1 while step N runs (vLLM's --async-scheduling); None: on for CUDA without speculative
    # decoding, off on the CPU (measured: benchmarks/async_scheduling.py).
    async_scheduling: bool | None = None
    # Caps on a request's stop strings (each is matched after every token): how many, and how long each.
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_length: int = DEFAULT_MAX_STOP_STRING_LENGTH
    # Most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs), as vLLM's --max-logprobs.
    max_logprobs: int = 20
    # Default sampling parameters: "auto" reads the model folder's generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty, max_new_tokens), "vllm" ignores it, a folder path reads that folder's.
    generation_config: str = "auto"
    # {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...} as in vLLM, or its JSON.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Settings whose defaults come from the environment, read here once (not deep in the library):
    # converted models and compiled kernels ($PAGED_RUNTIME_CACHE, else ~/.cache/paged_runtime);
    cache_dir: str = field(default_factory=lambda: str(default_cache_dir()))
    # the compiled CPU kernels on the CPU: None picks them where the CPU has their vector paths (AVX-512),
    # True / False force them on / off ($PAGED_RUNTIME_CPU_KERNELS=1 / 0);
    cpu_kernels: bool | None = field(default_factory=lambda: _env_flag(CPU_KERNELS_ENV))
    # torch | cpu | triton instead of the automatic choice ($PAGED_RUNTIME_ATTENTION_BACKEND).
    attention_backend: str | None = field(default_factory=lambda: os.environ.get(ATTENTION_BACKEND_ENV) or None)
    # Devices per model: tensor-parallel ranks x pipeline stages, one worker process each (vLLM's flags).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "mp" (local processes) or "ray" (Ray actors, any node); None: in-process for one device, Ray inside a
    # Ray cluster (a Serve replica), else local processes.
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_stop_strings", "max_stop_string_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_parallel()
        if self.async_scheduling and self.speculative_config is not None:
            # A verifying step's accepted count decides where the next one starts: nothing can be scheduled
            # behind it, and drafts need the previous token on the host (as vLLM, for its n-gram and draft models).
            raise ValueError("async_scheduling does not combine with speculative decoding: turn one of them off")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, "
                             f"got {self.distributed_executor_backend!r}")
        if self.world_size == 1:
            return
        # Only the sampling rank knows a step's tokens until the scheduler's next step tells the others.
        if self.async_scheduling:
            raise ValueError("async_scheduling needs one device: turn it off with tensor or pipeline parallelism")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError("a draft model needs one device: use speculative decoding with method ngram, or "
                             "tensor_parallel_size = pipeline_parallel_size = 1")

    @classmethod
    def from_attributes(cls, source: Any, **overrides: Any) -> EngineConfig:
        """From any object whose attributes carry these names (parsed CLI flags, an adapter's args);
        names it lacks keep their defaults, ``overrides`` win."""
        values = {f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}
        return cls(**(values | overrides))

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_dtype(requested: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' takes the checkpoint's dtype, with float16 on CPU promoted to bfloat16 (fp16 is slow there)."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested == "auto":
        dtype = _DTYPES.get(checkpoint_dtype or "bfloat16", torch.bfloat16)
        if dtype == torch.float32 and device.type == "cuda":
            dtype = torch.bfloat16
        return torch.bfloat16 if dtype == torch.float16 and device.type == "cpu" else dtype
    if requested not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {requested!r}")
    dtype = _DTYPES[requested]
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("dtype float16 is not supported on CPU; use bfloat16 or float32")
    return dtype
