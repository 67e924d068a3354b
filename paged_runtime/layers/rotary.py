"""Rotary position embedding: fp32 cos/sin tables for every position, computed once at load.

``inputs(positions, dtype)`` is what one step's layers share (gathered once per step, not per layer);
``forward`` splits a fused qkv into heads and rotates q and k.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from paged_runtime.layers.ops import TorchOps


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_len: int, base: float, scaling: dict | None, ops: TorchOps,
                 device: torch.device) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(head_dim, base, scaling))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)
        self.head_dim, self.ops = head_dim, ops

    def inputs(self, positions: torch.Tensor, dtype: torch.dtype):
        """This step's rotation, shared by every layer."""
        return self.ops.rope_inputs(self.cos, self.sin, positions, dtype)

    def forward(self, qkv: torch.Tensor, sizes: tuple[int, int, int], inputs) -> list[torch.Tensor]:
        """[T, q + k + v] -> q, k, v as [T, heads, head_dim], q and k rotated."""
        return self.ops.rope(qkv, sizes, self.head_dim, inputs)
