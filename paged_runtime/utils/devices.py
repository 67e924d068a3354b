"""The torch device and dtypes a config's names stand for (``EngineConfig.device`` / ``dtype`` /
``kv_cache_dtype``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# EngineConfig.dtype's names (config.DTYPES, "auto" apart) -> the dtype
TORCH_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}


def resolve_device(name: str) -> torch.device:
    """"auto": CUDA where there is one, else the CPU; anything else as torch reads it ("cuda:1")."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(requested: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto' takes the checkpoint's dtype, with float16 on CPU promoted to bfloat16 (fp16 is slow there)."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested == "auto":
        dtype = TORCH_DTYPES.get(checkpoint_dtype or "bfloat16", torch.bfloat16)
        if dtype == torch.float32 and device.type == "cuda":
            dtype = torch.bfloat16
        return torch.bfloat16 if dtype == torch.float16 and device.type == "cpu" else dtype
    dtype = TORCH_DTYPES[requested]  # a name outside config.DTYPES never gets this far
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("dtype float16 is not supported on CPU; use bfloat16 or float32")
    return dtype


@dataclass(frozen=True)
class Precision:
    """What a model computes in and keeps its KV cache in, resolved once by the engine for every rank."""
    dtype: torch.dtype  # activations (and plain weights)
    kv_cache_dtype: str  # a --kv-cache-dtype name (kernels/kv_quant.py); "auto": ``dtype``


# The KV cache under a GGUF's float32 default on the CPU, for kv_cache_dtype "auto": the activations' float32.
# A 16-bit cache (llama.cpp keeps an f16 one; "bfloat16" here would make it the default) holds twice the tokens and
# decodes faster (SmolLM2 Q4_1, 2-core Zen 4: 16 requests at 300 tokens 29.4 against 35.8 ms a step,
# benchmarks/kv_cache_dtype.py) at the same perplexity (27.35 against 27.47), but it flips the default model's answer to "What is the capital of France?"
# back to French landmarks: its first token is a near-tie ("The" 0.05 nats ahead of "L" with a float32 cache,
# 0.26 behind with a bfloat16 or float16 one).
GGUF_CPU_KV_CACHE = "auto"


def resolve_precision(dtype: str | torch.dtype, kv_cache_dtype: str, checkpoint_dtype: str | None,
                      device: torch.device, gguf_blocks: bool) -> Precision:
    """``EngineConfig.dtype`` / ``kv_cache_dtype`` for a model whose checkpoint says ``checkpoint_dtype``;
    ``gguf_blocks``: a GGUF served as its blocks (``models.loader.serves_gguf_blocks``).

    The one rule beyond ``resolve_dtype``: on the CPU such a GGUF computes in float32 for dtype "auto" (as
    llama.cpp does), its cache ``GGUF_CPU_KV_CACHE`` for kv_cache_dtype "auto". Its weights stay in their blocks
    whatever the activations, so float32 costs no weight memory and no speed at batch 1 (a decode step at 300
    tokens: 5.31 ms either way, the machine above; 35.8 against 31.0 ms at batch 16), while bfloat16 activations flip the default
    model's near-ties (France's capital again). An explicit dtype keeps its own cache ("auto": that dtype)."""
    if dtype == "auto" and gguf_blocks and device.type == "cpu":
        return Precision(torch.float32, GGUF_CPU_KV_CACHE if kv_cache_dtype == "auto" else kv_cache_dtype)
    return Precision(resolve_dtype(dtype, checkpoint_dtype, device), kv_cache_dtype)
