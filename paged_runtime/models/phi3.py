"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer, loaded from fused checkpoints, with its own RoPE.

- Checkpoints hold ``qkv_proj`` ([q; k; v] rows) and ``gate_up_proj`` ([gate; up] rows) whole: each is
  split into its parts and loaded as the Llama checkpoints' q/k/v and gate/up are, so every
  tensor-parallel rank still takes its own heads and its own slice of the MLP.
- Partial rotary (Phi-4-mini rotates 3/4 of each head) and LongRoPE (Phi-3.5, Phi-4-mini) are the
  rotary's (``layers/rotary.py``), read from ``ModelConfig.rope_scaling``; a long prompt's tokens read
  the long half of its tables through ``rope_position_offset``.
- ``sliding_window`` applies to every layer, as transformers' mask does (``phi3_config``).
The compiled decode step describes each of these (the rotated width, the tables the positions read, the
window), so a Phi-3 runs it as a Llama does.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from paged_runtime.models.config import ModelConfig, rope_scaling
from paged_runtime.models.gguf_spec import NORMS, GgufSpec, f32
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.models.registry import register


class Phi3ForCausalLM(LlamaForCausalLM):
    def fused_parts(self) -> dict[str, tuple[list[str], list[int]]]:
        """Fused checkpoint matrix -> (the Llama names of its parts, their rows), full (unsharded) sizes."""
        c = self.config
        kv = c.num_kv_heads * c.head_dim
        return {"qkv_proj": (["q_proj", "k_proj", "v_proj"], [c.num_heads * c.head_dim, kv, kv]),
                "gate_up_proj": (["gate_proj", "up_proj"], [c.intermediate_size] * 2)}

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """A fused tensor fills every shard of its parameter: its name comes back without a shard."""
        module_path, _, param_name = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        parts = self.fused_parts().get(leaf)
        if parts is None:
            return super().load_weight(name, tensor)
        names, sizes = parts
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {name} has {tensor.shape[0]} rows, expected {sum(sizes)}")
        filled = {super(Phi3ForCausalLM, self).load_weight(f"{parent}.{part}.{param_name}", t)
                  for part, t in zip(names, tensor.split(sizes))}
        targets = {f.partition("#")[0] for f in filled if f is not None}
        return targets.pop() if len(targets) == 1 and None not in filled else None

    def expected_weights(self) -> set[str]:
        return {name.partition("#")[0] for name in super().expected_weights()}


# ---- config.json -------------------------------------------------------------------------
def phi3_config(c: ModelConfig) -> ModelConfig:
    """transformers applies Phi-3's ``sliding_window`` on every layer (a sliding-window causal mask); one at
    least max_position_embeddings long (Phi-3.5 and Phi-4-mini: 262144) masks nothing. LongRoPE's original
    length defaults to Phi3Config's 4096, and "su" / "yarn" are its early checkpoints' names for LongRoPE."""
    raw, max_len = c.raw, c.max_position_embeddings
    window = raw.get("sliding_window")
    return dataclasses.replace(
        c, rope_scaling=rope_scaling(raw, max_len, renamed={"su": "longrope", "yarn": "longrope"},
                                     longrope_original=4096),
        layer_windows=(window,) * c.num_layers if window and window < max_len else (), sliding_window=None)


# ---- GGUF --------------------------------------------------------------------------------
def phi3_gguf_config(cfg: dict, hp: dict) -> None:
    p = hp["meta"]
    head_dim = hp["hidden"] // hp["n_head"]  # Phi-3 derives it; GGUF has no key_length here
    partial = int(p("rope.dimension_count", head_dim)) / head_dim
    original_ctx = int(p("rope.scaling.original_context_length", hp["ctx"]))
    window = int(p("attention.sliding_window", 0))  # llama.cpp writes 0 for "no window"
    cfg.update(head_dim=head_dim, partial_rotary_factor=partial, original_max_position_embeddings=original_ctx,
               sliding_window=window or None, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg["rope_parameters"]["partial_rotary_factor"] = partial
    factors = hp["config_tensors"]
    if not factors:
        return
    if len(factors) != 2:
        raise ValueError("GGUF phi3 has one of rope_factors_long/rope_factors_short but not both")
    scaling = {"type": "longrope", "rope_type": "longrope",
               "long_factor": factors["rope_factors_long.weight"],
               "short_factor": factors["rope_factors_short.weight"]}
    attn_factor = p("rope.scaling.attn_factor", None)
    if attn_factor is not None and not math.isclose(attn_factor, _longrope_attention(hp["ctx"], original_ctx),
                                                    rel_tol=1e-6):
        scaling["attention_factor"] = f32(attn_factor)  # only when it is not the one HF derives
    cfg["rope_scaling"] = scaling
    cfg["rope_parameters"] = {**scaling, "rope_theta": hp["rope_theta"], "partial_rotary_factor": partial,
                              "original_max_position_embeddings": original_ctx}


def _longrope_attention(ctx: int, original_ctx: int) -> float:
    # The cos/sin scale HF (and llama.cpp's converter) derive for LongRoPE.
    scale = ctx / original_ctx
    return math.sqrt(1 + math.log(scale) / math.log(original_ctx)) if scale > 1.0 else 1.0


# Pre-quantized checkpoints are refused: the fused tensors are split by rows, which packed layouts do not have.
register("Phi3ForCausalLM", Phi3ForCausalLM, config_hook=phi3_config,
         not_prequantized="its q/k/v and gate/up come fused in the checkpoint",
         gguf=GgufSpec(("phi3",), "phi3",
                       # Phi-3 checkpoints are fused; llama.cpp keeps them fused (ffn_up holds [gate; up]).
                       {**NORMS, "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                        "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
                       config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
                       config_hook=phi3_gguf_config, end_of_turn="<|end|>"))
