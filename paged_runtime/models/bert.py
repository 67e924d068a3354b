"""BERT (``BertModel``: sentence-transformers' all-MiniLM-L6-v2 and the like), an encoder-only family: it only pools.

As transformers' ``BertModel`` computes ``last_hidden_state``: word + token-type (type 0: one sequence) +
absolute position embeddings, LayerNorm; then per layer, post-norm: ``x = LN(x + attention(x))``, ``x = LN(x +
down(gelu(up(x))))``; no final norm. Attention is bidirectional over each request's whole prompt and keeps no KV
(``layers.attention.EncoderAttention`` over the encoder backend, ``attention/encoder_backend.py``); registering
the family ``encoder_only`` is what makes the engine run it so (``engine/core.py``). The pooler head
(``pooler.*``) is not loaded: the runtime pools the hidden states itself (CLS by default, as vLLM).

Checkpoint names are transformers' (``embeddings.*``, ``encoder.layer.N.*``), with or without the ``bert.``
prefix of its task models (whose heads, ``cls.*``, are ignored too).
"""
from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from paged_runtime.layers.attention import EncoderAttention
from paged_runtime.layers.linear import (SINGLE, ColumnParallelLinear, LinearMethod, QKVParallelLinear,
                                         RowParallelLinear, TensorParallel, UnquantizedLinearMethod)
from paged_runtime.layers.norm import LayerNorm
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.pipeline import WHOLE, PipelineStage
from paged_runtime.layers.vocab import VocabParallelEmbedding
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.registry import register
from paged_runtime.models.weights import expected_parameters, load_parameter

# config.json hidden_act -> F.gelu's approximate ("gelu_new" is transformers' tanh formula under another name)
GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# transformers' module names inside encoder.layer.N -> ours inside layers.N, and the part of a fused matrix
LAYER_NAMES = {"attention.self.query": ("qkv_proj", "q"), "attention.self.key": ("qkv_proj", "k"),
               "attention.self.value": ("qkv_proj", "v"), "attention.output.dense": ("o_proj", None),
               "attention.output.LayerNorm": ("attention_norm", None), "intermediate.dense": ("up_proj", None),
               "output.dense": ("down_proj", None), "output.LayerNorm": ("mlp_norm", None)}
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")


class BertEmbeddings(nn.Module):
    """Module names as transformers' (the checkpoint's ``embeddings.*`` load as they are)."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype, device, tp)
        self.position_embeddings = VocabParallelEmbedding(c.max_position_embeddings, c.hidden_size, dtype, device)
        self.token_type_embeddings = VocabParallelEmbedding(c.raw.get("type_vocab_size", 2), c.hidden_size, dtype,
                                                            device)
        self.LayerNorm = LayerNorm(c.hidden_size, c.raw.get("layer_norm_eps", 1e-12), dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # transformers' order of additions: (words + token type 0) + positions
        x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertLayer(nn.Module):
    """One post-norm block (transformers' ``encoder.layer.N``; ``LAYER_NAMES`` maps its names): q/k/v fused, with
    biases, as every linear here."""

    def __init__(self, c: ModelConfig, method: LinearMethod, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel) -> None:
        super().__init__()
        eps = c.raw.get("layer_norm_eps", 1e-12)
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_heads, c.num_heads, True, method, dtype,
                                          device, tp)
        self.o_proj = RowParallelLinear(c.hidden_size, c.hidden_size, True, method, dtype, device, tp)
        self.attention_norm = LayerNorm(c.hidden_size, eps, dtype, device)
        self.up_proj = ColumnParallelLinear(c.hidden_size, c.intermediate_size, True, method, dtype, device, tp)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, True, method, dtype, device, tp)
        self.mlp_norm = LayerNorm(c.hidden_size, eps, dtype, device)
        p = self.qkv_proj
        self.attn = EncoderAttention(p.num_heads, p.num_kv_heads, c.head_dim, c.head_dim ** -0.5)
        self.approximate = GELU[c.raw.get("hidden_act", "gelu")]

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).unflatten(-1, (-1, self.attn.head_dim)).split(
            [self.attn.num_heads, self.attn.num_kv_heads, self.attn.num_kv_heads], dim=1)
        x = self.attention_norm(x + self.o_proj(self.attn(q, k, v, meta).flatten(1)))
        return self.mlp_norm(x + self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate)))


class BertModel(nn.Module):
    """``forward(input_ids, positions, meta)`` -> the last layer's hidden states ([num_tokens, hidden]), what the
    runner pools; there is no LM head (an encoder-only family never samples)."""
    rope_switch = None  # absolute positions: ``positions`` are the tokens' own

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device,
                 ops: TorchOps | None = None, tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        if stage.size > 1:
            raise ValueError(f"{config.architecture} runs on one pipeline stage: set pipeline_parallel_size 1")
        self.config = config
        method = method or UnquantizedLinearMethod(ops or TorchOps())
        self.embeddings = BertEmbeddings(config, dtype, device, tp)
        self.layers = nn.ModuleList(BertLayer(config, method, dtype, device, tp) for _ in range(config.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, decoder=None) -> torch.Tensor:
        """``meta``: the encoder backend's (each item one whole prompt); ``decoder`` is for decoder models (None)."""
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, meta)
        return x

    # ---- weights -----------------------------------------------------------------------
    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Copy one checkpoint tensor into place; what it filled, None for what is not loaded (pooler, heads)."""
        module_path, _, param_name = name.removeprefix("bert.").rpartition(".")
        shard = None
        layer = _LAYER.fullmatch(module_path)
        if layer is not None:
            if layer[2] not in LAYER_NAMES:
                return None
            part, shard = LAYER_NAMES[layer[2]]
            module_path = f"layers.{layer[1]}.{part}"
        elif not module_path.startswith("embeddings."):
            return None  # pooler.*, cls.* (task heads)
        return load_parameter(self, module_path, param_name, tensor, shard, name)

    def expected_weights(self) -> set[str]:
        return expected_parameters(self)

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


def bert_config(c: ModelConfig) -> ModelConfig:
    """transformers' BertModel as this family computes it (absolute positions, a GELU, an encoder), q/k/v biases;
    ValueError naming what else a config asks for."""
    raw, name = c.raw, c.architecture
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{name} with position_embedding_type {raw['position_embedding_type']!r} is not supported "
                         f"(absolute only)")
    if raw.get("hidden_act", "gelu") not in GELU:
        raise ValueError(f"{name} with hidden_act {raw['hidden_act']!r} is not supported; supported: "
                         f"{', '.join(GELU)}")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise ValueError(f"{name} as a decoder (is_decoder, add_cross_attention) is not supported: it runs as an "
                         f"encoder")
    return dataclasses.replace(c, attention_bias=True)


register("BertModel", BertModel, config_hook=bert_config, encoder_only=True, pooling_type="CLS",
         not_prequantized="its loader maps plain weights only")
