"""Mixtral: the Llama (Mistral) layer with a sparse mixture of experts (``layers/moe.py``) for its MLP.

Also the base of the other expert families (``qwen3_moe.py``, ``olmoe.py``): reading the experts' shape
from config.json (``ExpertsConfig``), building a layer's ``SparseMoeBlock``, and loading expert weights
in both checkpoint layouts:

- per expert, as published checkpoints and transformers' ``save_pretrained`` write them:
  ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (Mixtral) or ``mlp.experts.{e}.gate_proj/up_proj/
  down_proj.weight`` (Qwen3-MoE, OLMoE);
- stacked, as transformers 5 holds them in memory (``save_pretrained(save_original_format=False)``):
  ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I].

Mixtral renormalises its top-k routing weights and scales the experts by them in float32. Its
``sliding_window`` (when set) reaches attention through ``ModelConfig.window``, as Mistral's does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from paged_runtime.layers.linear import UnquantizedLinearMethod
from paged_runtime.layers.moe import FusedMoE, SparseMoeBlock
from paged_runtime.models.config import ModelConfig, every_layer_slides
from paged_runtime.models.gguf_spec import ATTENTION, NORMS, GgufSpec
from paged_runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from paged_runtime.models.registry import register

# Checkpoint name (after "model." and Mixtral's block_sparse_moe -> mlp) -> (experts module, expert, matrix)
PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
STACKED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
SHARD_IDS = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}
# Why the expert families refuse pre-quantized checkpoints: experts load through FusedMoE, which has no
# quantized method.
EXPERTS_REFUSED = "mixture of experts"


@dataclass(frozen=True)
class ExpertsConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool

    @classmethod
    def from_model_config(cls, c: ModelConfig, renormalize: bool) -> ExpertsConfig:
        raw = c.raw
        # Mixtral names the count num_local_experts, OLMoE and published Qwen3-MoE configs num_experts;
        # transformers 5 saves Qwen3-MoE's under num_local_experts (its attribute map).
        num_experts = raw.get("num_local_experts") or raw.get("num_experts")
        if not num_experts or "num_experts_per_tok" not in raw:
            raise ValueError(f"{c.architecture} config.json lacks num_experts / num_experts_per_tok")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{c.architecture} with hidden_act={raw['hidden_act']!r} is not supported (silu only)")
        return cls(num_experts, raw["num_experts_per_tok"], raw.get("moe_intermediate_size") or c.intermediate_size,
                   renormalize)


def sparse_moe_block(c: ModelConfig, e: ExpertsConfig, ops, dtype, device, tp,
                     fp32_routing_weights: bool = False) -> SparseMoeBlock:
    experts = FusedMoE(e.num_experts, e.top_k, c.hidden_size, e.intermediate_size, e.renormalize, ops, dtype,
                       device, tp, fp32_routing_weights)
    # The router stays in the model dtype whatever the layers' method (as vLLM): routing is sensitive to it.
    return SparseMoeBlock(experts, c.hidden_size, UnquantizedLinearMethod(ops), dtype, device)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, c, ops, method, dtype, device, tp, layer_index) -> SparseMoeBlock:
        experts = ExpertsConfig.from_model_config(c, renormalize=True)
        return sparse_moe_block(c, experts, ops, dtype, device, tp, fp32_routing_weights=True)


class MixtralForCausalLM(LlamaForCausalLM):
    """Also the weight loading of every expert family: per-expert and stacked expert tensors."""
    decoder_layer_class = MixtralDecoderLayer

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | list[str] | None:
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if match := PER_EXPERT.match(name):
            path, expert, matrix = match.groups()
            return self._load_expert(path, tensor, SHARD_IDS[matrix], int(expert), name)
        if match := STACKED.match(name):
            path, kind = match.groups()
            return self._load_stacked(path, kind, tensor, name)
        return super().load_weight(name, tensor)

    def _load_expert(self, path: str, tensor: torch.Tensor, shard_id: str, expert: int, name: str) -> str | None:
        try:
            experts = self.get_submodule(path)
        except AttributeError:
            return None  # e.g. a layer this model lacks
        param_name = experts.param_name(shard_id)
        try:
            experts.weight_loader(getattr(experts, param_name), tensor, shard_id, expert)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name}: {e}") from e
        return f"{path}.{param_name}#{expert}.{shard_id}"

    def _load_stacked(self, path: str, kind: str, tensor: torch.Tensor, name: str) -> list[str]:
        """[E, 2I, H] gate_up_proj (gate rows, then up rows) or [E, H, I] down_proj, one expert at a time."""
        if tensor.dim() != 3:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected 3 dimensions")
        filled = []
        for expert, matrix in enumerate(tensor):
            parts = [("w2", matrix)] if kind == "down_proj" else zip(("w1", "w3"), matrix.chunk(2, dim=0))
            filled += [self._load_expert(path, part, shard_id, expert, name) for shard_id, part in parts]
        return [f for f in filled if f is not None]

    def expected_weights(self) -> set[str]:
        names = super().expected_weights()
        for path, module in self.named_modules():
            if isinstance(module, FusedMoE):
                names -= {f"{path}.w13_weight", f"{path}.w2_weight"}
                names |= {f"{path}.{shard}" for shard in module.checkpoint_shards()}
        return names


def mixtral_gguf_config(cfg: dict, hp: dict) -> None:
    p = hp["meta"]
    cfg.update(
        num_local_experts=hp["n_expert"],
        num_experts_per_tok=int(p("expert_used_count")),
        sliding_window=None,
        router_jitter_noise=0.0,
        output_router_logits=False,
        router_aux_loss_coef=0.02,
    )


# Every layer slides (when sliding_window is set), as Mistral's. llama.cpp writes Mixtral as "llama" (or
# "mistral") with experts: the converter tells it from Llama by expert_count.
register("MixtralForCausalLM", MixtralForCausalLM, config_hook=every_layer_slides, not_prequantized=EXPERTS_REFUSED,
         gguf=GgufSpec(("llama", "mistral"), "mixtral",
                       {**NORMS, **ATTENTION, "ffn_gate_inp": "block_sparse_moe.gate"},
                       experts={"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                                "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
                                "ffn_up_exps": "block_sparse_moe.experts.{e}.w3"},
                       permute_qk=True, config_hook=mixtral_gguf_config))
