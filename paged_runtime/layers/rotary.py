"""Rotary position embedding: fp32 cos/sin tables for every position, computed once at load.

``inputs(positions, dtype)`` is what one step's layers share (gathered once per step, not per layer);
``forward`` splits a fused qkv into heads and rotates q and k.

Partial rotary (``partial_rotary_factor`` < 1 in the scaling dict, as Phi-4-mini): only the first
``rotary_dim`` dims of each head rotate, the tables are that wide, and the ops pass the rest through.

LongRoPE (``rope_type`` "longrope", Phi-3.5, Phi-4-mini): frequencies divided by per-dim
``short_factor``s, or ``long_factor``s for a sequence longer than ``original_max_position_embeddings``
(``switch``), and cos/sin scaled by an attention factor. transformers' ``generate`` rotates a sequence by
one set throughout: short while it is at most ``switch`` tokens long, long once it is longer (its KV cache
is recomputed at the crossing; the scheduler does the same here). One table of ``2 * max_len`` rows holds
both: rows ``p`` position p short, rows ``max_len + p`` position p long; ``position_offset`` says which
half a request reads.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from paged_runtime.layers.ops import TorchOps


def rope_kind(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rotary_dim(head_dim: int, scaling: dict | None) -> int:
    """The leading dims of each head that rotate (Hugging Face's ``int(head_dim * partial_rotary_factor)``)."""
    return int(head_dim * (scaling or {}).get("partial_rotary_factor", 1.0))


def rope_inv_freq(dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of a ``dim``-wide rotation (longrope: the short ones; see ``longrope_inv_freq``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "longrope":
        return longrope_inv_freq(dim, base, scaling["short_factor"])
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, longrope)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def longrope_inv_freq(dim: int, base: float, factors: list[float]) -> torch.Tensor:
    """Hugging Face's expression to the bit: the factor multiplies base^(2i/dim) before the reciprocal."""
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext_factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def longrope_attention_factor(s: dict) -> float:
    """cos/sin scale: ``attention_factor``, else sqrt(1 + ln(factor) / ln(original max)) when factor > 1
    (``factor`` defaults to max_position_embeddings / original max: ``ModelConfig`` fills it in)."""
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    factor, original = s["factor"], s["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_len: int, base: float, scaling: dict | None, ops: TorchOps,
                 device: torch.device) -> None:
        super().__init__()
        dim, positions = rotary_dim(head_dim, scaling), torch.arange(max_len)
        self.switch, self.long_offset = None, 0  # LongRoPE: the length past which the long half is read
        if rope_kind(scaling) == "longrope":
            scale = longrope_attention_factor(scaling)
            short = _cos_sin(positions, longrope_inv_freq(dim, base, scaling["short_factor"]), scale)
            long = _cos_sin(positions, longrope_inv_freq(dim, base, scaling["long_factor"]), scale)
            cos, sin = torch.cat([short[0], long[0]]), torch.cat([short[1], long[1]])
            self.switch, self.long_offset = scaling["original_max_position_embeddings"], max_len
        else:
            cos, sin = _cos_sin(positions, rope_inv_freq(dim, base, scaling))
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.head_dim, self.rotary_dim, self.ops = head_dim, dim, ops

    @property
    def one_table(self) -> bool:
        """Whole heads rotate, each token by the row of its true position: what ``ops.decoder_layer`` reads."""
        return self.rotary_dim == self.head_dim and not self.long_offset

    def position_offset(self, num_tokens: np.ndarray) -> np.ndarray:
        """Per request (elementwise, by its length so far), what to add to its positions to read its rows."""
        if self.switch is None:
            return np.zeros_like(num_tokens)
        return np.where(np.asarray(num_tokens) > self.switch, self.long_offset, 0)

    def inputs(self, positions: torch.Tensor, dtype: torch.dtype):
        """This step's rotation, shared by every layer; ``positions`` are table rows (``position_offset``)."""
        return self.ops.rope_inputs(self.cos, self.sin, positions, dtype)

    def forward(self, qkv: torch.Tensor, sizes: tuple[int, int, int], inputs) -> list[torch.Tensor]:
        """[T, q + k + v] -> q, k, v as [T, heads, head_dim], q and k rotated."""
        return self.ops.rope(qkv, sizes, self.head_dim, inputs)
