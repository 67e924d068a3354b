"""Gemma 3 (text; ``Gemma3ForCausalLM``, the 1B checkpoint's architecture) over a paged KV cache.

Against Llama: embeddings scaled by sqrt(hidden) (rounded to the weight dtype first); RMSNorms that scale by
``1 + weight`` in fp32; four norms per layer, the attention and MLP outputs normed before their residual adds;
per-head q/k norms before RoPE; attention scaled by ``query_pre_attn_scalar ** -0.5``; GeGLU; tied embeddings;
and interleaved layer kinds: local layers attend to a sliding window with their own RoPE base, global layers
to the whole context with ``rope_theta`` and ``rope_scaling`` (``gemma3_rope``). Each kind's rotation is
gathered once per step. Weight loading is Llama's (same checkpoint names, q/k/v and gate/up fused).

Hugging Face's Gemma 3 stores ``attn_logit_softcapping`` but never applies it (transformers 5.24:
``Gemma3Attention`` does not pass it to any attention function; Gemma 3 has q/k norms instead), so neither do
we: the oracle's output is what the model means. ``final_logit_softcapping`` is applied, as there.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from paged_runtime.layers.activation import GeluTanhAndMul
from paged_runtime.layers.attention import Attention
from paged_runtime.layers.decode_plan import LayerDescription, attention_fields, matrix_description, norm_description
from paged_runtime.layers.linear import (SINGLE, LinearMethod, MergedColumnParallelLinear, QKVParallelLinear,
                                         RowParallelLinear, TensorParallel, UnquantizedLinearMethod)
from paged_runtime.layers.norm import GemmaRMSNorm
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.pipeline import WHOLE, PipelineStage
from paged_runtime.layers.rotary import RotaryEmbedding
from paged_runtime.layers.vocab import ParallelLMHead, ScaledEmbedding
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.gguf_spec import ATTENTION, DENSE_MLP, QK_NORM, GgufSpec, f32
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.models.registry import register


class Gemma3Attention(nn.Module):
    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, ops: TorchOps, method, dtype, device,
                 tp: TensorParallel, layer_index: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.attention_bias,
                                          method, dtype, device, tp)
        self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, c.attention_bias, method, dtype,
                                        device, tp)
        p = self.qkv_proj
        self.sizes, self.head_dim, self.rotary = (p.q_size, p.kv_size, p.kv_size), c.head_dim, rotary
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, ops, dtype, device)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps, ops, dtype, device)
        scale = c.raw.get("query_pre_attn_scalar", 256) ** -0.5
        self.attn = Attention(p.num_heads, p.num_kv_heads, c.head_dim, scale, c.window(layer_index))

    def forward(self, x: torch.Tensor, rope, meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        qkv = torch.cat([self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k), v], dim=-1)
        q, k, v = self.rotary(qkv, self.sizes, rope)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))

    def _norm_heads(self, norm: GemmaRMSNorm, t: torch.Tensor) -> torch.Tensor:
        """Each head_dim slice of [T, heads * head_dim] normalised on its own (rows of [T * heads, head_dim])."""
        return norm(t.reshape(-1, self.head_dim))[0].view(t.shape[0], -1)

    def describe(self) -> dict:
        return dict(qkv=matrix_description(self.qkv_proj, bias=True), o=matrix_description(self.o_proj),
                    q_norm=norm_description(self.q_norm, unit_offset=True),
                    k_norm=norm_description(self.k_norm, unit_offset=True), **attention_fields(self.attn, self.rotary))


class Gemma3MLP(nn.Module):
    def __init__(self, c: ModelConfig, ops: TorchOps, method, dtype, device, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, False, method,
                                                       dtype, device, tp)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, False, method, dtype, device, tp)
        self.act = GeluTanhAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def describe(self) -> dict:
        return dict(gate_up=matrix_description(self.gate_up_proj), down=matrix_description(self.down_proj),
                    activation="gelu_tanh")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, ops: TorchOps, method, dtype, device,
                 tp: TensorParallel, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(c, rotary, ops, method, dtype, device, tp, layer_index)
        self.mlp = Gemma3MLP(c, ops, method, dtype, device, tp)
        norm = lambda: GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, ops, dtype, device)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's: x is the previous layer's output, not yet added to ``residual`` (None before the first).
        Here that output is already post-normed; the residual stream itself never is."""
        x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rope, meta))[0]
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x))[0], residual

    def describe(self) -> LayerDescription:
        """Four norms, each scaling by 1 + w: before attention, on its output, before the MLP, on its output."""
        norm = lambda module: norm_description(module, unit_offset=True)  # noqa: E731
        return LayerDescription(attn_norm=norm(self.input_layernorm), attn_out_norm=norm(self.post_attention_layernorm),
                                mlp_norm=norm(self.pre_feedforward_layernorm),
                                mlp_out_norm=norm(self.post_feedforward_layernorm), eps=self.input_layernorm.eps,
                                **self.self_attn.describe(), **self.mlp.describe())


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Builds its own modules (none of Llama's constructor applies); inherits Llama's weight loading and its
    layer descriptions."""
    rope_switch = None  # no LongRoPE: each layer kind rotates every request by one table

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device,
                 ops: TorchOps | None = None, tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE,
                 method: LinearMethod | None = None) -> None:
        nn.Module.__init__(self)
        self.config, self.ops, self.dtype = config, ops or TorchOps(), dtype
        method = method or UnquantizedLinearMethod(self.ops)  # the decoder layers'; the vocabulary's below
        vocab = method.vocab_method()
        # One rotary per layer kind; a module dict so that each layer's rotary is found by its kind.
        self.rotaries = nn.ModuleDict({
            kind: RotaryEmbedding(config.head_dim, max_len, base, scaling, self.ops, device)
            for kind, (base, scaling) in gemma3_rope(config.raw).items()})
        self.layer_kinds = gemma3_layer_types(config.raw)
        self.init_stage(stage, lambda: ScaledEmbedding(config.vocab_size, config.hidden_size,
                                                       config.hidden_size ** 0.5, dtype, device, tp, vocab),
                        lambda i: Gemma3DecoderLayer(config, self.rotaries[self.layer_kinds[i]], self.ops, method,
                                                     dtype, device, tp, i),
                        lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, self.ops, dtype, device),
                        lambda: ParallelLMHead(config.vocab_size, config.hidden_size,
                                               vocab or UnquantizedLinearMethod(self.ops), dtype, device, tp))
        if self.lm_head is not None:
            self.lm_head.softcap = config.raw.get("final_logit_softcapping")

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's, each layer rotated by its kind's tables (each kind's rotation gathered once a step)."""
        ropes = {kind: rotary.inputs(positions, x.dtype) for kind, rotary in self.rotaries.items()}
        for i in self.held:
            x, residual = self.layers[i](x, residual, ropes[self.layer_kinds[i]], meta)
        return x, residual


# ---- config.json -------------------------------------------------------------------------
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma3_layer_types(raw: dict) -> list[str]:
    """Each decoder layer's kind: ``layer_types``, or else the older ``sliding_window_pattern`` P (every P-th
    layer full, the rest sliding; Hugging Face's default P is 6)."""
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= set(GEMMA3_LAYER_TYPES):
        raise ValueError(f"Gemma3 layer_types must name each of the {n} layers one of {GEMMA3_LAYER_TYPES}, "
                         f"got {types}")
    return list(types)


def gemma3_rope(raw: dict) -> dict[str, tuple[float, dict | None]]:
    """Per layer kind, RoPE's (base, scaling): global layers ``rope_theta`` with ``rope_scaling``, local ones
    ``rope_local_base_freq`` unscaled (transformers 4.x keys); transformers 5 keys ``rope_parameters`` by kind."""
    params = raw.get("rope_parameters") or {}
    if not set(params) & set(GEMMA3_LAYER_TYPES):
        params = {"full_attention": {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1e6)},
                  "sliding_attention": {"rope_theta": raw.get("rope_local_base_freq", 1e4)}}
    rope = {}
    for kind, default_base in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        p = params.get(kind) or {}
        scaled = p.get("rope_type", p.get("type", "default")) != "default"
        rope[kind] = (p.get("rope_theta", default_base), p if scaled else None)
    return rope


def gemma3_config(c: ModelConfig) -> ModelConfig:
    """What Gemma 3 reads differently: windows per layer (``sliding_window`` is None, so that max_model_len is
    not capped to the local layers' window), the global layers' RoPE, tied embeddings unless said otherwise."""
    raw = c.raw
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM with use_bidirectional_attention=true (an embedding model) is not "
                         "supported: attention here is causal")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma3ForCausalLM with hidden_activation {activation!r} is not supported "
                         "(only gelu_pytorch_tanh)")
    window = raw.get("sliding_window")
    theta, scaling = gemma3_rope(raw)["full_attention"]
    return dataclasses.replace(
        c, layer_windows=tuple(window if t == "sliding_attention" else None for t in gemma3_layer_types(raw)),
        sliding_window=None, rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", True))


# ---- GGUF --------------------------------------------------------------------------------
# llama.cpp hard-codes Gemma 3's layout rather than storing it: every 6th layer is global (unless the
# file carries attention.sliding_window_pattern), local layers use rope base 10000, and the 27B
# (62 layers) scales queries by hidden/heads, the others by head_dim.
GGUF_PATTERN = 6
GGUF_LOCAL_THETA = 10000.0


def gemma3_gguf_config(cfg: dict, hp: dict) -> None:
    p = hp["meta"]
    n = hp["n_layer"]
    local_theta = f32(p("rope.freq_base_swa", GGUF_LOCAL_THETA))
    softcap = p("final_logit_softcapping", None)
    full_rope = {"rope_type": "default", "rope_theta": hp["rope_theta"], **(hp["rope_scaling"] or {})}
    pattern = p("attention.sliding_window_pattern", GGUF_PATTERN)
    sliding = _sliding_layers(pattern, n)
    del cfg["hidden_act"]  # Gemma's key is hidden_activation
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=hp["hidden"] // hp["n_head"] if n == 62 else hp["head_dim"],
        sliding_window=int(p("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_base_freq=local_theta,
        rope_scaling=hp["rope_scaling"],
        rope_parameters={"full_attention": full_rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        final_logit_softcapping=None if softcap is None else f32(softcap),
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    )
    if not isinstance(pattern, list):
        cfg["sliding_window_pattern"] = int(pattern)  # the 4.x key published configs carry


def _sliding_layers(pattern, n_layer: int) -> list[bool]:
    # GGUF's sliding_window_pattern: an int n (every n-th layer global) or one bool per layer (true: sliding).
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
        return [bool(x) for x in pattern]
    return [(i + 1) % int(pattern) != 0 for i in range(n_layer)]


register("Gemma3ForCausalLM", Gemma3ForCausalLM, config_hook=gemma3_config,
         gguf=GgufSpec(("gemma3",), "gemma3_text",
                       # Gemma's ffn_norm is the pre-feedforward norm; its post-attention norm has its own name.
                       {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                        **ATTENTION, **QK_NORM, **DENSE_MLP},
                       # Gemma 3 (4B and up) scales its global layers' rope linearly.
                       norm_offset=1.0, rope_scalings=("linear",), config_hook=gemma3_gguf_config,
                       end_of_turn="<end_of_turn>"))
