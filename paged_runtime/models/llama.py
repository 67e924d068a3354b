"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Numerics follow Hugging Face's implementation step for step (RMSNorm in fp32,
rotate-half RoPE, residual order) so greedy outputs match it token for token.
q/k/v and gate/up are fused into single matmuls; logits are computed only for
the rows that are sampled. The arithmetic itself is ``ops`` (models/ops.py): plain
PyTorch, or the compiled CPU kernels with the same rounding points.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paged_runtime.attention import AttentionMetadata
from paged_runtime.kernels import cpu as cpu_kernels
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.ops import TorchOps


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (checked there).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """The norm's weight and epsilon; the op itself is ``ops.rms_norm`` (fused with the residual add)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: TorchOps,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to the model length, computed once (fp32)."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device, ops: TorchOps) -> None:
        super().__init__()
        self.ops, self.head_dim = ops, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, c.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (_param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
                         if c.attention_bias else None)
        self.o_weight = _param(c.hidden_size, self.q_size, dtype=dtype, device=device)
        self.scale = c.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.ops.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = self.ops.rope(qkv, (self.q_size, self.kv_size, self.kv_size), self.head_dim, rope)
        out = meta.attend(q, k, v, kv_cache, self.scale)  # the backend the runner built meta for
        return self.ops.linear(out.reshape(-1, self.q_size), self.o_weight)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_weight = _param(2 * c.intermediate_size, c.hidden_size, dtype=dtype, device=device)
        self.down_weight = _param(c.hidden_size, c.intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self.ops.silu_mul(self.ops.linear(x, self.gate_up_weight)), self.down_weight)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Attention(c, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = MLP(c, dtype, device, ops)
        self._kernel_tensors = self._kernel_weights = None

    def kernel_weights(self) -> cpu_kernels.LayerWeights:
        """This layer's weights for the fused CPU decode kernel: raw pointers, so rebuilt whenever a weight
        has moved (``.to()``, a reassigned ``.data``) since they were taken."""
        if self._kernel_tensors is None:
            a, m = self.self_attn, self.mlp
            self._kernel_tensors = (self.input_layernorm.weight, a.qkv_weight, a.qkv_bias, a.o_weight,
                                    self.post_attention_layernorm.weight, m.gate_up_weight, m.down_weight)
        where = [0 if t is None else t.data_ptr() for t in self._kernel_tensors]
        if self._kernel_weights is None or self._kernel_weights[0] != where:
            self._kernel_weights = where, cpu_kernels.LayerWeights.of(*self._kernel_tensors, self.input_layernorm.eps)
        return self._kernel_weights[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to ``residual`` (None before the first layer)."""
        x, residual = self.input_layernorm(x, self.ops, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta), self.ops, residual)
        return self.mlp(x), residual


# HF checkpoint name -> (our parameter suffix, shard index within a fused matrix or None)
_FUSED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_weight", 0), "self_attn.k_proj.weight": ("self_attn.qkv_weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_weight", 2), "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_bias", 1), "self_attn.v_proj.bias": ("self_attn.qkv_bias", 2),
    "self_attn.o_proj.weight": ("self_attn.o_weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_weight", 0), "mlp.up_proj.weight": ("mlp.gate_up_weight", 1),
    "mlp.down_proj.weight": ("mlp.down_weight", None),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device,
                 ops: TorchOps | None = None) -> None:
        super().__init__()
        self.config, self.ops = config, ops or TorchOps()
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, self.ops) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.rotary = RotaryEmbedding(config, max_len, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Flat batch of tokens in, final hidden states out ([num_tokens, hidden])."""
        x = F.embedding(input_ids, self.embed_tokens)
        fused = self.ops.decode_layers(self, x, positions, kv_caches, meta)
        if fused is not None:
            x, residual = fused
        else:
            rope, residual = self.ops.rope_inputs(self.rotary.cos, self.rotary.sin, positions, x.dtype), None
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, self.ops, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.lm_head).float()

    def linear_weights(self) -> list[torch.Tensor]:
        """Every matrix ``ops.linear`` multiplies by (the LM head once, even when tied)."""
        mats = [m for layer in self.layers for m in (layer.self_attn.qkv_weight, layer.self_attn.o_weight,
                                                      layer.mlp.gate_up_weight, layer.mlp.down_weight)]
        return mats + [self.lm_head]

    # ---- weights ---------------------------------------------------------------
    def shard_sizes(self, fused_name: str) -> list[int]:
        a = self.layers[0].self_attn
        if fused_name.startswith("self_attn.qkv"):
            return [a.q_size, a.kv_size, a.kv_size]
        return [self.config.intermediate_size] * 2

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Copy one checkpoint tensor into place; returns the parameter it filled (or None if unused)."""
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight":
            if self.config.tie_word_embeddings:
                return None
            target, shard = "lm_head", None
        elif name in ("embed_tokens.weight", "norm.weight"):
            target, shard = name.removesuffix(".weight") if name.startswith("embed") else name, None
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            suffix, shard = _FUSED.get(rest, (rest, None))
            target = f"layers.{index}.{suffix}"
        else:
            return None  # e.g. rotary inv_freq buffers in old checkpoints
        param = self.get_parameter(target)
        if shard is not None:
            sizes = self.shard_sizes(target.split(".", 2)[2])
            param = param.narrow(0, sum(sizes[:shard]), sizes[shard])
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(tensor)
        return f"{target}#{shard}" if shard is not None else target

    def expected_weights(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            if name.endswith(("qkv_weight", "qkv_bias")):
                names.update(f"{name}#{i}" for i in range(3))
            elif name.endswith("gate_up_weight"):
                names.update(f"{name}#{i}" for i in range(2))
            else:
                names.add(name)
        return names


MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
                 "Qwen2ForCausalLM": LlamaForCausalLM}
