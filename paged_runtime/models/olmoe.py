"""OLMoE: the Llama layer with an RMSNorm over the WHOLE q and k projections (one norm across all heads,
unlike Qwen3's per-head one), an optional ``clip_qkv`` clamp of q, k and v after it, and experts for the
MLP (renormalised iff ``norm_topk_prob``, default false; weights rounded to the model dtype as
transformers does).
"""
from __future__ import annotations

import torch

from paged_runtime.layers.decode_plan import Undescribable
from paged_runtime.layers.linear import RowParallelLinear
from paged_runtime.layers.norm import RMSNorm
from paged_runtime.models.llama import LlamaAttention, LlamaDecoderLayer
from paged_runtime.models.mixtral import EXPERTS_REFUSED, ExpertsConfig, MixtralForCausalLM, sparse_moe_block
from paged_runtime.models.registry import register


class OlmoeAttention(LlamaAttention):
    def __init__(self, c, rotary, ops, method, dtype, device, tp, layer_index=0) -> None:
        if tp.size > 1:  # the norm spans every head: it would need the other ranks' q and k
            raise NotImplementedError("OlmoeForCausalLM is not supported with tensor parallelism")
        super().__init__(c, rotary, ops, method, dtype, device, tp, layer_index)
        if c.attention_bias:  # transformers gives OLMoE's o_proj a bias too
            self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, True, method, dtype, device,
                                            tp)
        q_size, kv_size, _ = self.sizes
        self.q_norm = RMSNorm(q_size, c.rms_norm_eps, ops, dtype, device)
        self.k_norm = RMSNorm(kv_size, c.rms_norm_eps, ops, dtype, device)
        self.clip_qkv = c.raw.get("clip_qkv")

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        qkv = torch.cat([self.q_norm(q)[0], self.k_norm(k)[0], v], dim=-1)
        return qkv if self.clip_qkv is None else qkv.clamp_(-self.clip_qkv, self.clip_qkv)

    def describe(self) -> dict:
        raise Undescribable("OLMoE's q/k norms span all heads and its qkv may be clipped")


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention

    def make_mlp(self, c, ops, method, dtype, device, tp, layer_index):
        experts = ExpertsConfig.from_model_config(c, renormalize=c.raw.get("norm_topk_prob", False))
        return sparse_moe_block(c, experts, ops, dtype, device, tp)


class OlmoeForCausalLM(MixtralForCausalLM):
    decoder_layer_class = OlmoeDecoderLayer


# The generic config.json reading is OLMoE's; no GGUF file converts to it.
register("OlmoeForCausalLM", OlmoeForCausalLM, not_prequantized=EXPERTS_REFUSED)
