"""A decoder layer described as data, for the compiled CPU decode step (``worker/cpu_decode_plan.py``).

A model describes each layer once, after its weights load (``describe_decoder_layers``): which norms it has
and how each applies its weight, its four matrices as their linear methods hold them, its q/k norms, its RoPE
tables and rotated width, its attention (heads, scale, window, soft-cap) and its MLP's activation. The C side
(``kernels/cpu_ops.c``: ``LayerWeights``, ``StackLayer``, ``decode_layer``) runs exactly that, so a family's
difference is an entry here, not a second model: Qwen3 adds q/k norms, Gemma 3 its four norms with (1 + w)
weights, GeGLU and per-layer RoPE tables, Phi-3 a partial rotary and LongRoPE's tables.

The data flow, with the residual carried beside the stream (as every family's forward does)::

    attn_norm(residual += x) -> qkv (+ bias) -> q_norm / k_norm per head -> RoPE -> store K/V -> attention
    -> o -> attn_out_norm -> mlp_norm(residual += that) -> gate_up -> activation -> down -> mlp_out_norm -> x

With LoRA on (``layers/lora.py``) each matrix describes its adapter slots too, and each product (qkv, o,
gate_up, down) gets each row's delta added as ``LinearBase.forward`` adds it op by op.

What a layer cannot be described as (experts, a weight format the kernels do not read, a tensor-parallel
shard) raises ``Undescribable``: the model then runs op by op, as it does for every step the plan does not
take.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class Undescribable(Exception):
    """The layers cannot run as the compiled decode step; the message says why (logged once at start-up)."""


@dataclass(frozen=True)
class NormDescription:
    weight: torch.Tensor
    unit_offset: bool = False  # Gemma: h * (1 + w) in fp32, rounded once; else Llama's w * dt(h)


@dataclass(frozen=True)
class LoRADescription:
    """A linear layer's adapter slots (``layers/lora.LoRAWeights``): ``a`` [S, N*R, in], ``b`` [S, out, R],
    ``slices`` the N parts' output widths; ``step`` the row -> slot map all the layers share, which the runner
    sets before each step (the plan hands its rows to the C step: each row's delta joins each product)."""
    a: torch.Tensor
    b: torch.Tensor
    slices: tuple[int, ...]
    step: object  # layers/lora.LoRAStep


@dataclass(frozen=True)
class MatrixDescription:
    parts: tuple[tuple[torch.Tensor, int], ...]  # stacked by output rows: (tensor, PLAIN or a GGUF type id)
    bias: torch.Tensor | None = None
    lora: LoRADescription | None = None  # the layer's adapter slots, where LoRA is on


@dataclass(frozen=True)
class LayerDescription:
    attn_norm: NormDescription
    qkv: MatrixDescription
    o: MatrixDescription
    mlp_norm: NormDescription
    gate_up: MatrixDescription  # gate rows, then up rows
    down: MatrixDescription
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    cos: torch.Tensor  # this layer's RoPE tables, float32 [rows, rot]; rows as the forward's positions read them
    sin: torch.Tensor
    rot: int  # leading dims of each q / k head that rotate
    kv_cache: torch.Tensor  # the attention's cache and an 8-bit cache's scales, as the runner bound them
    kv_scale: torch.Tensor | None = None
    window: int | None = None
    softcap: float | None = None
    q_norm: NormDescription | None = None  # per head, before RoPE (Qwen3, Gemma 3)
    k_norm: NormDescription | None = None
    attn_out_norm: NormDescription | None = None  # on the attention's output before the residual (Gemma 3)
    mlp_out_norm: NormDescription | None = None  # on the MLP's output before the residual (Gemma 3)


def norm_description(norm, unit_offset: bool = False) -> NormDescription:
    """An RMSNorm module (``layers/norm.py``) as a description."""
    return NormDescription(norm.weight, unit_offset)


def matrix_description(linear, bias: bool = False) -> MatrixDescription:
    """A linear layer as the kernels read it: its method's parts (``LinearMethod.describe``), where the
    step adds one (``bias``: the qkv projection's) its bias, and its adapter slots where it has them."""
    parts = linear.method.describe(linear)
    if parts is None:
        raise Undescribable(f"{type(linear.method).__name__} weights are not read by the compiled decode step")
    if linear.tp.size > 1:
        raise Undescribable("a tensor-parallel shard needs its all-reduce between the layer's products")
    if linear.bias is not None and not bias:
        raise Undescribable("the compiled decode step adds a bias to the qkv projection only")
    lora = linear.lora
    return MatrixDescription(tuple(parts), linear.bias, None if lora is None else LoRADescription(
        lora.a, lora.b, lora.slices, lora.step))


def attention_fields(attn, rotary) -> dict:
    """The description's attention and RoPE fields from an ``Attention`` module bound to its cache and the
    layer's ``RotaryEmbedding``."""
    return dict(heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
                window=attn.sliding_window, softcap=attn.logit_softcap, kv_cache=attn.kv_cache,
                kv_scale=attn.kv_scale, cos=rotary.cos, sin=rotary.sin, rot=rotary.rotary_dim)
