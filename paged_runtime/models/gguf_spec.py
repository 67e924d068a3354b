"""What a model family declares about its GGUF files (torch-free: the converter imports it, and so do the
family files, which register a ``GgufSpec`` with their ``ModelFamily`` in ``models/registry.py``).

A spec says which llama.cpp ``general.architecture`` names the family converts from and how: llama.cpp's
per-block tensor names -> the Hugging Face module paths of the family's published checkpoints, llama.cpp's
storage conventions to undo, and what goes into config.json and generation_config.json beyond the keys
every family shares (``gguf_convert._build_config``).

Invariant: within the families serving one llama.cpp name, at most one has experts and at most one has
none; the converter picks between them by the file's ``expert_count`` (llama.cpp writes Mixtral as
"llama" with experts).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# GGUF block tensor part -> HF module path under ``model.layers.{i}``, shared by most families.
ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

# cfg: the config.json being built (edited in place); hp: the file's hyperparameters as the converter reads
# them: "meta" (key, default) -> the file's "<arch>.<key>", and "n_layer", "hidden", "ffn", "n_head",
# "n_head_kv", "head_dim", "eps", "rope_theta", "rope_scaling", "ctx", "vocab", "n_expert",
# "config_tensors" (name -> float list).
ConfigJsonHook = Callable[[dict, dict], None]


@dataclass(frozen=True)
class GgufSpec:
    architectures: tuple[str, ...]  # llama.cpp general.architecture names this family converts from
    model_type: str  # config.json "model_type" of the family's published checkpoints
    block: dict[str, str]  # GGUF part -> HF module path (one tensor each)
    experts: dict[str, str] = field(default_factory=dict)  # stacked [E, ...] part -> path with {e}
    permute_qk: bool = False  # llama.cpp only permutes q/k for llama-style models
    qkv_bias: bool = False  # qwen2 carries q/k/v biases
    norm_offset: float = 0.0  # Gemma: llama.cpp stores RMSNorm weights as 1 + w
    config_tensors: tuple[str, ...] = ()  # GGUF tensors that go into config.json, not the weights
    # llama.cpp rope.scaling.type values read as {"rope_type": type, "factor": rope.scaling.factor};
    # any other type but "none" is refused.
    rope_scalings: tuple[str, ...] = ()
    config_hook: ConfigJsonHook | None = None  # the family's own config.json keys
    # A chat turn's end when it is not the GGUF's eos: generation_config.json lists both (published
    # generation configs do; llama.cpp stops on it by its text).
    end_of_turn: str | None = None


def f32(x: float) -> float:
    """``x`` as the shortest decimal of its float32: GGUF stores float32, and 1e-05 reads better than
    9.999999747378752e-06."""
    return float(str(np.float32(x)))
