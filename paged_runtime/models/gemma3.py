"""Gemma 3 (text; ``Gemma3ForCausalLM``, the 1B checkpoint's architecture) over a paged KV cache.

Against Llama: embeddings scaled by sqrt(hidden) (rounded to the weight dtype first); RMSNorms that scale by
``1 + weight`` in fp32; four norms per layer, the attention and MLP outputs normed before their residual adds;
per-head q/k norms before RoPE; attention scaled by ``query_pre_attn_scalar ** -0.5``; GeGLU; tied embeddings;
and interleaved layer kinds: local layers attend to a sliding window with their own RoPE base, global layers
to the whole context with ``rope_theta`` and ``rope_scaling`` (``config.gemma3_rope``). Each kind's rotation is
gathered once per step. Weight loading is Llama's (same checkpoint names, q/k/v and gate/up fused).

Hugging Face's Gemma 3 stores ``attn_logit_softcapping`` but never applies it (transformers 5.24:
``Gemma3Attention`` does not pass it to any attention function; Gemma 3 has q/k norms instead), so neither do
we: the oracle's output is what the model means. ``final_logit_softcapping`` is applied, as there.
"""
from __future__ import annotations

import torch
from torch import nn

from paged_runtime.layers.activation import GeluTanhAndMul
from paged_runtime.layers.attention import Attention
from paged_runtime.layers.linear import (SINGLE, LinearMethod, MergedColumnParallelLinear, QKVParallelLinear,
                                         RowParallelLinear, TensorParallel, UnquantizedLinearMethod)
from paged_runtime.layers.norm import GemmaRMSNorm
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.pipeline import WHOLE, PipelineStage
from paged_runtime.layers.rotary import RotaryEmbedding
from paged_runtime.layers.vocab import ParallelLMHead, ScaledEmbedding
from paged_runtime.models.config import ModelConfig, gemma3_layer_types, gemma3_rope
from paged_runtime.models.llama import LlamaForCausalLM


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


class Gemma3MLP(nn.Module):
    def __init__(self, c: ModelConfig, ops: TorchOps, method, dtype, device, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, False, method,
                                                       dtype, device, tp)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, False, method, dtype, device, tp)
        self.act = GeluTanhAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


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


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Builds its own modules (none of Llama's constructor applies); inherits Llama's weight loading."""
    one_op_layer = False  # ops.decoder_layer is Llama's layer
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
        self.fusable = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """Flat batch of tokens in, final hidden states out ([num_tokens, hidden]); see Llama's for stages."""
        x, residual = self.stage_input(input_ids)
        ropes = {kind: rotary.inputs(positions, x.dtype) for kind, rotary in self.rotaries.items()}
        for i in self.held:
            x, residual = self.layers[i](x, residual, ropes[self.layer_kinds[i]], meta)
        return self.stage_output(x, residual)
