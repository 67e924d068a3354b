"""Attention backends over the paged KV cache, each a ``build_metadata(batch, device)``.

- ``torch``: pure PyTorch on any device; the oracle for the others.
- ``cpu``: the compiled CPU kernels for one-token query rows (decodes and
  verifications), PyTorch for prompt chunks; chosen on the CPU with the kernel op set.
- ``triton``: the Triton kernels; chosen on CUDA.
- ``encoder``: bidirectional attention within each request and no KV cache; chosen for an encoder-only
  model (``ModelFamily.encoder_only``) on any device, whatever was requested (the others attend causally
  over the paged cache).

The model runner builds a step's metadata for one backend from the step's batch,
and the metadata dispatches to it (``meta.attend``): the model never names a
backend. ``EngineConfig.attention_backend`` overrides the automatic choice
(torch on CUDA to compare; triton on CPU only under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from paged_runtime.attention import cpu_backend, encoder_backend, torch_backend, triton_backend
from paged_runtime.batch import StepBatch
from paged_runtime.kernels import triton_available

ENCODER = "encoder"
BUILDERS: dict[str, Callable[[StepBatch, torch.device], object]] = {
    "torch": torch_backend.build_metadata, "cpu": cpu_backend.build_metadata,
    "triton": triton_backend.build_metadata, ENCODER: encoder_backend.build_metadata}
BACKENDS = ("torch", "cpu", "triton")  # the paged backends, which a config may request (config.ATTENTION_BACKENDS)


class AttentionMetadata(Protocol):
    """A step's attention metadata, built by the runner for one backend."""
    rows_only: bool  # only one-token query rows: the runner's compiled CPU decode step may run the layers

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               window: int | None = None, softcap: float | None = None,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Store k/v ([T, Hkv, D]) into the cache; return attention of q ([T, H, D]) over it, each query
        over its last ``window`` positions (None: all) with scores soft-capped at ``softcap`` (None: not)
        -- the meaning of ``layers.attention.Attention``'s ``sliding_window`` and ``logit_softcap``.
        An 8-bit ``kv_cache`` (fp8 / int8) comes with its ``kv_scale`` (``kernels.kv_quant``): quantized on
        store, dequantized on read."""
        ...


def select_backend(device: torch.device, cpu_kernels: bool, requested: str | None = None,
                   encoder_only: bool = False) -> str:
    """``encoder`` for an encoder-only model (the one backend that attends both ways; ``requested`` names a
    decoder's choice, e.g. from the environment, and is ignored); else ``requested`` if given; else triton on
    CUDA where it imports, the kernels' backend on the CPU when the model runs the CPU kernel op set
    (``cpu_kernels``), torch everywhere else."""
    if encoder_only:
        return ENCODER
    if requested:
        if requested not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {requested!r}")
        if requested == "triton" and not triton_available():
            raise ValueError("attention_backend triton, but triton is not installed")
        if requested == "cpu" and not cpu_kernels:
            raise ValueError("attention_backend cpu needs the CPU kernels (on the CPU, not enforce_eager)")
        return requested
    if uses_triton(device, None):
        return "triton"
    return "cpu" if cpu_kernels else "torch"


def uses_triton(device: torch.device, requested: str | None) -> bool:
    """Whether ``select_backend`` picks triton whatever the op set (the op set's own choice follows it)."""
    return requested == "triton" or (not requested and device.type == "cuda" and triton_available())
