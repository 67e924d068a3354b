"""Attention backends over the paged KV cache.

- ``torch``: pure PyTorch on any device; the CPU path and the oracle for the others.
- ``triton``: the Triton kernels of ``paged_runtime.kernels``; chosen on CUDA.

The model runner builds a step's metadata for one backend, and the metadata
dispatches to it (``meta.attend``): the model never names a backend.
``PAGED_RUNTIME_ATTENTION_BACKEND=torch|triton`` overrides the automatic choice
(torch on CUDA to compare; triton on CPU only under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from paged_runtime.kernels import triton_available

BACKENDS = ("torch", "triton")
BACKEND_ENV = "PAGED_RUNTIME_ATTENTION_BACKEND"


class AttentionMetadata(Protocol):
    """A step's attention metadata, built by the runner for one backend."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Store k/v ([T, Hkv, D]) into the cache; return attention of q ([T, H, D]) over it."""
        ...


def select_backend(device: torch.device) -> str:
    """Triton on CUDA where it imports, torch everywhere else, unless the environment says otherwise."""
    requested = os.environ.get(BACKEND_ENV)
    if requested:
        if requested not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}; got {requested!r}")
        if requested == "triton" and not triton_available():
            raise ValueError(f"{BACKEND_ENV}=triton, but triton is not installed")
        return requested
    return "triton" if device.type == "cuda" and triton_available() else "torch"
