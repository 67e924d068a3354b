"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, ``models/qwen3.py``) with experts for the MLP.

Which layers have experts: those not in ``mlp_only_layers`` whose number (from 1) is a multiple of
``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``. Experts are
``moe_intermediate_size`` wide; the top-k routing weights are renormalised iff ``norm_topk_prob``, and
rounded to the model dtype before they scale the experts (as transformers does).
"""
from __future__ import annotations

import dataclasses

from paged_runtime.models.config import ModelConfig
from paged_runtime.models.gguf_spec import ATTENTION, NORMS, QK_NORM, GgufSpec
from paged_runtime.models.llama import LlamaMLP
from paged_runtime.models.mixtral import EXPERTS_REFUSED, ExpertsConfig, MixtralForCausalLM, sparse_moe_block
from paged_runtime.models.qwen3 import Qwen3DecoderLayer, qwen3_gguf_config
from paged_runtime.models.registry import register


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


def qwen3_moe_config(c: ModelConfig) -> ModelConfig:
    """``sliding_window`` only under ``use_sliding_window`` (then on the layers ``layer_types`` marks)."""
    if c.raw.get("use_sliding_window", False):
        return c
    return dataclasses.replace(c, sliding_window=None, layer_windows=())


def qwen3_moe_gguf_config(cfg: dict, hp: dict) -> None:
    p = hp["meta"]
    qwen3_gguf_config(cfg, hp)
    cfg.update(
        # Published Qwen3-MoE configs say num_experts; transformers 5 renamed it num_local_experts.
        num_experts=hp["n_expert"],
        num_local_experts=hp["n_expert"],
        num_experts_per_tok=int(p("expert_used_count")),
        moe_intermediate_size=int(p("expert_feed_forward_length")),
        # llama.cpp always renormalises the top-k router weights for qwen3moe.
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )


register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM, config_hook=qwen3_moe_config, not_prequantized=EXPERTS_REFUSED,
         gguf=GgufSpec(("qwen3moe",), "qwen3_moe", {**NORMS, **ATTENTION, **QK_NORM, "ffn_gate_inp": "mlp.gate"},
                       experts={"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                                "ffn_down_exps": "mlp.experts.{e}.down_proj"},
                       config_hook=qwen3_moe_gguf_config))
