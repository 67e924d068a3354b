"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, ``models/qwen3.py``) with experts for the MLP.

Which layers have experts: those not in ``mlp_only_layers`` whose number (from 1) is a multiple of
``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``. Experts are
``moe_intermediate_size`` wide; the top-k routing weights are renormalised iff ``norm_topk_prob``, and
rounded to the model dtype before they scale the experts (as transformers does).
"""
from __future__ import annotations

from paged_runtime.models.llama import LlamaMLP
from paged_runtime.models.mixtral import ExpertsConfig, MixtralForCausalLM, sparse_moe_block
from paged_runtime.models.qwen3 import Qwen3DecoderLayer


def has_experts(raw: dict, layer_index: int) -> bool:
    if layer_index in (raw.get("mlp_only_layers") or []):
        return False
    num_experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    return num_experts > 0 and (layer_index + 1) % raw.get("decoder_sparse_step", 1) == 0


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, c, ops, method, dtype, device, tp, layer_index):
        if not has_experts(c.raw, layer_index):
            return LlamaMLP(c, ops, method, dtype, device, tp)
        experts = ExpertsConfig.from_model_config(c, renormalize=c.raw.get("norm_topk_prob", False))
        return sparse_moe_block(c, experts, ops, dtype, device, tp)


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    decoder_layer_class = Qwen3MoeDecoderLayer
    one_op_layer = False  # q/k norms and experts: ops.decoder_layer has neither
