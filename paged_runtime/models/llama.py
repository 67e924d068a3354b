"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Numerics follow Hugging Face's implementation step for step (RMSNorm in fp32,
rotate-half RoPE, residual order) so greedy outputs match it token for token.
q/k/v and gate/up are fused into single matrices; logits are computed only for
the rows that are sampled. The arithmetic is the op set's (``layers/ops.py``). Each
layer also describes itself as data (``describe``: ``layers/decode_plan.py``), which
the runner's compiled CPU decode step runs (``worker/cpu_decode_plan.py``, handed to
``forward`` as its ``decoder``). A family that adds steps subclasses these classes
through their hooks (``project_qkv``, ``attention_class``, ``make_mlp``,
``decoder_layer_class``) and describes what it adds, as ``models/qwen3.py`` does.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from paged_runtime.layers.activation import SiluAndMul
from paged_runtime.layers.attention import Attention
from paged_runtime.layers.decode_plan import (LayerDescription, attention_fields, matrix_description,
                                              norm_description)
from paged_runtime.layers.linear import (SINGLE, LinearMethod, MergedColumnParallelLinear, QKVParallelLinear,
                                         RowParallelLinear, TensorParallel, UnquantizedLinearMethod)
from paged_runtime.layers.norm import RMSNorm
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.pipeline import WHOLE, MissingLayer, PipelineStage
from paged_runtime.layers.rotary import RotaryEmbedding
from paged_runtime.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from paged_runtime.models.config import ModelConfig, every_layer_slides, windows_from_types
from paged_runtime.models.gguf_spec import ATTENTION, DENSE_MLP, NORMS, GgufSpec
from paged_runtime.models.registry import register
from paged_runtime.models.weights import expected_parameters, load_parameter


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, ops: TorchOps, method, dtype, device,
                 tp: TensorParallel = SINGLE, layer_index: int = 0) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.attention_bias,
                                          method, dtype, device, tp)
        self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, False, method, dtype, device, tp)
        p = self.qkv_proj
        self.sizes = (p.q_size, p.kv_size, p.kv_size)
        self.rotary = rotary
        self.attn = Attention(p.num_heads, p.num_kv_heads, c.head_dim, c.head_dim ** -0.5, c.window(layer_index))

    def forward(self, x: torch.Tensor, rope, meta) -> torch.Tensor:
        q, k, v = self.rotary(self.project_qkv(x), self.sizes, rope)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The fused [T, q + k + v] rows that RoPE rotates (a family may transform them first)."""
        return self.qkv_proj(x)

    def describe(self) -> dict:
        """The attention's fields of the layer's description (a family adding q/k norms adds them here)."""
        return dict(qkv=matrix_description(self.qkv_proj, bias=True), o=matrix_description(self.o_proj),
                    **attention_fields(self.attn, self.rotary))


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig, ops: TorchOps, method, dtype, device,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, False, method,
                                                       dtype, device, tp)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, False, method, dtype, device, tp)
        self.act = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def describe(self) -> dict:
        return dict(gate_up=matrix_description(self.gate_up_proj), down=matrix_description(self.down_proj),
                    activation="silu")


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, ops: TorchOps, method, dtype, device,
                 tp: TensorParallel = SINGLE, layer_index: int = 0) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = self.attention_class(c, rotary, ops, method, dtype, device, tp, layer_index)
        self.mlp = self.make_mlp(c, ops, method, dtype, device, tp, layer_index)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, ops, dtype, device)

    def make_mlp(self, c: ModelConfig, ops: TorchOps, method, dtype, device, tp: TensorParallel,
                 layer_index: int) -> nn.Module:
        """This layer's feed-forward block (a family may choose per layer, e.g. experts on some layers)."""
        return LlamaMLP(c, ops, method, dtype, device, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to ``residual`` (None before the first layer)."""
        x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, meta), residual)
        return self.mlp(x), residual

    def describe(self) -> LayerDescription:
        """This layer as the compiled decode step runs it (raises ``Undescribable`` where it cannot: experts)."""
        return LayerDescription(attn_norm=norm_description(self.input_layernorm),
                                mlp_norm=norm_description(self.post_attention_layernorm),
                                eps=self.input_layernorm.eps, **self.self_attn.describe(), **self.mlp.describe())


class LlamaForCausalLM(nn.Module):
    decoder_layer_class = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device,
                 ops: TorchOps | None = None, tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE,
                 method: LinearMethod | None = None) -> None:
        """``method``: how the decoder layers' linear layers hold and multiply their weights (default: plain
        weights; ``layers/quantization`` has the others). The embedding and LM head take its ``vocab_method``
        (plain for the methods that quantize at load, as vLLM; a GGUF file's own blocks)."""
        super().__init__()
        self.config, self.ops, self.dtype = config, ops or TorchOps(), dtype
        method = method or UnquantizedLinearMethod(self.ops)
        self.rotary = RotaryEmbedding(config.head_dim, max_len, config.rope_theta, config.rope_scaling, self.ops,
                                      device)
        vocab = method.vocab_method()
        self.init_stage(stage, lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp,
                                                              vocab),
                        lambda i: self.decoder_layer_class(config, self.rotary, self.ops, method, dtype, device, tp, i),
                        lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, self.ops, dtype, device),
                        lambda: ParallelLMHead(config.vocab_size, config.hidden_size,
                                               vocab or UnquantizedLinearMethod(self.ops), dtype, device, tp))

    def init_stage(self, stage: PipelineStage, embedding, decoder_layer, norm, lm_head) -> None:
        """Build the modules pipeline stage ``stage`` holds (each argument makes one); the others are None
        (``MissingLayer`` for decoder layers), so their checkpoint tensors are skipped at load."""
        self.stage, self.held = stage, stage.layer_range(self.config.num_layers)
        tied = self.config.tie_word_embeddings
        self.embed_tokens = embedding() if stage.is_first or (stage.is_last and tied) else None
        self.layers = nn.ModuleList(decoder_layer(i) if i in self.held else MissingLayer()
                                    for i in range(self.config.num_layers))
        self.norm = norm() if stage.is_last else None
        self.lm_head = lm_head() if stage.is_last else None
        if self.lm_head is not None and tied:
            self.lm_head.tie(self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, decoder=None) -> torch.Tensor | None:
        """Flat batch of tokens in, final hidden states out ([num_tokens, hidden]). ``positions`` pick the
        rotary's rows (``rope_position_offset``); attention reads true positions from ``meta``. ``decoder``:
        the runner's compiled decode step for this step (``worker/cpu_decode_plan.py``), which runs the layers
        instead of the loop below. A pipeline stage before the last sends its output on and returns None."""
        x, residual = self.stage_input(input_ids)
        x, residual = (decoder or self.run_layers)(x, residual, positions, meta)
        return self.stage_output(x, residual)

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The held decoder layers op by op: (x, residual) entering the first -> leaving the last."""
        rope = self.rotary.inputs(positions, x.dtype)
        for i in self.held:
            x, residual = self.layers[i](x, residual, rope, meta)
        return x, residual

    def describe_decoder_layers(self) -> list[LayerDescription]:
        """Every held decoder layer as data, for the compiled decode step (``layers/decode_plan.py``); call it
        once the weights are loaded and the caches bound. Raises ``Undescribable`` with the reason."""
        return [self.layers[i].describe() for i in self.held]

    def stage_input(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) entering this stage's first layer: the embeddings, or what the stage before sent."""
        if self.stage.is_first:
            return self.embed_tokens(input_ids), None
        return self.stage.receive(len(input_ids), self.config.hidden_size, self.dtype, input_ids.device)

    def stage_output(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states on the last stage; elsewhere (x, residual) go to the next stage."""
        if not self.stage.is_last:
            self.stage.send(x, residual)
            return None
        return self.norm(x, residual)[0]

    @property
    def rope_switch(self) -> int | None:
        """LongRoPE: a request longer than this many tokens is rotated by other tables throughout, so its KV is
        recomputed when it grows past it (the scheduler's ``rope_switch``); None for one rotation for all."""
        return self.rotary.switch

    def rope_position_offset(self, num_tokens: np.ndarray) -> np.ndarray:
        """Per request, by its length so far, what the runner adds to its tokens' positions to make the
        ``positions`` this model takes (rows of the rotary's tables): 0 unless LongRoPE's long half."""
        return self.rotary.position_offset(num_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the given rows."""
        return self.lm_head(hidden)

    # ---- weights -----------------------------------------------------------------------
    # HF checkpoint name suffix -> (our module path suffix, shard id within a fused matrix)
    FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Copy one checkpoint tensor into place; returns what it filled ("param#shard"), None if unused."""
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if not name.startswith(("layers.", "embed_tokens.", "norm.", "lm_head.")):
            return None  # e.g. rotary inv_freq buffers in old checkpoints
        module_name, _, param_name = name.rpartition(".")
        module_path, shard = self.checkpoint_module(module_name)
        return load_parameter(self, module_path, param_name, tensor, shard, name)

    def checkpoint_module(self, module_name: str) -> tuple[str, str | int | None]:
        """A checkpoint's module name (``model.layers.0.self_attn.q_proj``) -> (our module's path, its part in
        a fused matrix, or None: the whole module). Weights and LoRA adapters (``lora/peft.py``) both map so."""
        module_path = module_name.removeprefix("model.")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in self.FUSED:
            leaf, shard = self.FUSED[leaf]
            return f"{parent}.{leaf}", shard
        return module_path, None

    def expected_weights(self) -> set[str]:
        return expected_parameters(self, skip=self.lm_head if self.config.tie_word_embeddings else None)

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


# ---- the families this class computes ------------------------------------------------------
def llama_config(c: ModelConfig) -> ModelConfig:
    """Hugging Face's Llama attends to everything, whatever its ``sliding_window`` or ``layer_types``."""
    return dataclasses.replace(c, layer_windows=())


def qwen2_config(c: ModelConfig) -> ModelConfig:
    """Qwen2: q/k/v biases unless said otherwise; ``sliding_window`` only under ``use_sliding_window``, on the
    layers ``layer_types`` marks, or else (its config's default types) on layers i >= ``max_window_layers``."""
    raw = c.raw
    sliding = c.sliding_window if raw.get("use_sliding_window", False) else None
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(c.num_layers)]
    return dataclasses.replace(c, sliding_window=sliding, layer_windows=windows_from_types(types, sliding),
                               attention_bias=raw.get("attention_bias", True))


register("LlamaForCausalLM", LlamaForCausalLM, config_hook=llama_config,
         # llama.cpp's "mistral" is the same layout; with experts, both are Mixtral (models/mixtral.py).
         gguf=GgufSpec(("llama", "mistral"), "llama", {**NORMS, **ATTENTION, **DENSE_MLP}, permute_qk=True))
register("MistralForCausalLM", LlamaForCausalLM, config_hook=every_layer_slides)
register("Qwen2ForCausalLM", LlamaForCausalLM, config_hook=qwen2_config,
         gguf=GgufSpec(("qwen2",), "qwen2", {**NORMS, **ATTENTION, **DENSE_MLP}, qkv_bias=True))
