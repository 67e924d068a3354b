"""The torch device and dtype a config's names stand for (``EngineConfig.device`` / ``dtype``)."""
from __future__ import annotations

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
