"""Qwen3 (dense): the Llama layer with a per-head RMSNorm on q and on k, between the projection and RoPE.

Also unlike Qwen2: an explicit ``head_dim`` (often not hidden / heads) and no q/k/v bias by default --
both read by ``ModelConfig``. The compiled one-op Llama layer (``ops.decoder_layer``) has no q/k norms,
so Qwen3 always runs op by op.
"""
from __future__ import annotations

import torch

from paged_runtime.layers.norm import RMSNorm
from paged_runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


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


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Qwen3DecoderLayer
    one_op_layer = False  # ops.decoder_layer would skip the q/k norms
