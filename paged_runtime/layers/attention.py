"""Attention over the paged KV cache: one module, whichever backend the step's metadata belongs to.

The runner allocates each layer's cache and binds it here (``bind_kv_caches``); every step it builds the
attention metadata for the selected backend, and ``meta.attend`` stores the new K/V and attends. The model
never names a backend. ``EncoderAttention`` (encoder-only models) keeps no cache: ``attention_layers`` does not
list it, so nothing is allocated or budgeted for it, and it runs on the encoder backend's metadata.
"""
from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    """``sliding_window`` W: a query at position p sees keys p - W + 1 .. p (W keys, its own included; as
    Hugging Face's and vLLM's masks); None sees the whole context. ``logit_softcap`` c: each score s becomes
    ``c * tanh(s / c)`` before the mask and softmax (Gemma); None leaves scores as they are."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.kv_cache: torch.Tensor | None = None  # [num_slots, 2, num_kv_heads, head_dim], bound by the runner
        # An 8-bit cache's scales (fp8: [2] k/v per tensor; int8: [num_slots, 2, num_kv_heads]); None: model dtype.
        self.kv_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q [T, H, D], k / v [T, Hkv, D] -> [T, H, D]."""
        return meta.attend(q, k, v, self.kv_cache, self.scale, self.sliding_window, self.logit_softcap,
                           self.kv_scale)


class EncoderAttention(nn.Module):
    """Bidirectional attention within each request of the step and no KV cache (an encoder-only model's; the
    worker gives such a model the encoder backend, ``attention/encoder_backend.py``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q [T, H, D], k / v [T, Hkv, D] -> [T, H, D]."""
        return meta.attend(q, k, v, None, self.scale)


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor],
                   kv_scales: list[torch.Tensor | None] | None = None) -> None:
    """Give each attention layer of ``model``, in order, its cache (and an 8-bit cache's scales)."""
    layers = attention_layers(model)
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
    for layer, kv_cache, kv_scale in zip(layers, kv_caches, kv_scales or [None] * len(layers)):
        layer.kv_cache, layer.kv_scale = kv_cache, kv_scale
