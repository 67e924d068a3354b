"""Qwen3 (dense): the Llama layer with a per-head RMSNorm on q and on k, between the projection and RoPE.

Also unlike Qwen2: an explicit ``head_dim`` (often not hidden / heads) and no q/k/v bias by default --
both read by ``ModelConfig``. The compiled decode step runs the q/k norms from the layer's description.
"""
from __future__ import annotations

import dataclasses

import torch

from paged_runtime.layers.decode_plan import norm_description
from paged_runtime.layers.norm import RMSNorm
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.gguf_spec import ATTENTION, DENSE_MLP, NORMS, QK_NORM, GgufSpec
from paged_runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from paged_runtime.models.registry import register


class Qwen3Attention(LlamaAttention):
    def __init__(self, c, rotary, ops, method, dtype, device, tp, layer_index=0) -> None:
        super().__init__(c, rotary, ops, method, dtype, device, tp, layer_index)
        self.head_dim = c.head_dim
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, ops, dtype, device)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, ops, dtype, device)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        return torch.cat([self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k), v], dim=-1)

    def _norm_heads(self, norm: RMSNorm, t: torch.Tensor) -> torch.Tensor:
        """Each head_dim slice of [T, heads * head_dim] normalised on its own (rows of [T * heads, head_dim])."""
        return norm(t.reshape(-1, self.head_dim))[0].view(t.shape[0], -1)

    def describe(self) -> dict:
        return super().describe() | dict(q_norm=norm_description(self.q_norm), k_norm=norm_description(self.k_norm))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer


def qwen3_config(c: ModelConfig) -> ModelConfig:
    """Full context on every layer; ``use_sliding_window`` is refused (Qwen3 would slide only its layers past
    ``max_window_layers``, and attention here is the same on every layer)."""
    if c.raw.get("use_sliding_window", False):
        raise ValueError("Qwen3ForCausalLM with use_sliding_window=true is not supported: attention here is "
                         "full-context on every layer (set use_sliding_window to false in config.json)")
    return dataclasses.replace(c, sliding_window=None, layer_windows=())


def qwen3_gguf_config(cfg: dict, hp: dict) -> None:
    cfg.update(sliding_window=None, max_window_layers=hp["n_layer"])


register("Qwen3ForCausalLM", Qwen3ForCausalLM, config_hook=qwen3_config,
         gguf=GgufSpec(("qwen3",), "qwen3", {**NORMS, **ATTENTION, **QK_NORM, **DENSE_MLP},
                       config_hook=qwen3_gguf_config))
