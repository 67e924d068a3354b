"""Fused elementwise kernels for a decoder layer: residual add + RMSNorm, RoPE, SiLU-and-mul.

Each is one launch where the plain-torch path (``TorchOps``) takes several, and each
rounds to the model dtype at the same points as ``TorchOps`` (the math in between is
fp32), so in fp32 they agree with it to the last bits.

Inputs have a contiguous last dim; rows may be strided. Grids depend only on shapes
(no host reads of device data), so CUDA graphs can capture every launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                     stride_res_out, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.)
    dtype = x.dtype
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(dtype)  # the sum in the model dtype, as torch rounds it
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1. / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * rstd).to(dtype).to(tl.float32)  # Llama rounds before the weight's multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(residual + x), residual + x) as new tensors ([T, H] each); with no residual,
    (weight * norm(x), x). Nothing is written in place."""
    num_tokens, hidden = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x)
    res_out = x if residual is None else torch.empty_like(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    if num_tokens:
        res_in = x if residual is None else residual
        _rms_norm_kernel[(num_tokens,)](
            x, res_in, weight, out, res_out, x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            eps, HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None)
    return out, res_out


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_table,
                 NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    head = tl.arange(0, HEADS_P)[:, None]
    dim = tl.arange(0, HALF_P)[None, :]
    mask = (head < NUM_HEADS) & (dim < HALF)
    lo_ptr = qkv_ptr + token * stride_t + head * (2 * HALF) + dim
    x1 = tl.load(lo_ptr, mask=mask, other=0.)
    x2 = tl.load(lo_ptr + HALF, mask=mask, other=0.)
    dtype = x1.dtype
    # torch's path rounds the fp32 tables to the model dtype, each product, then their sum.
    table = pos * stride_table + dim
    cos1 = tl.load(cos_ptr + table, mask=dim < HALF).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=dim < HALF).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=dim < HALF).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=dim < HALF).to(dtype).to(tl.float32)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(lo_ptr, out1.to(dtype), mask=mask)
    tl.store(lo_ptr + HALF, out2.to(dtype), mask=mask)


def rope_(qkv: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate-half (neox) RoPE, in place, over the first ``num_heads`` heads of each row of ``qkv``
    ([T, >= num_heads * head_dim]: q's heads then k's are adjacent, so one pass rotates both), token t by
    table row ``positions[t]`` of the fp32 ``cos`` / ``sin`` ([rows, head_dim], whole heads rotate)."""
    num_tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cos.shape[-1] == head_dim and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1 and head_dim % 2 == 0
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0),
                                NUM_HEADS=num_heads, HALF=half, HEADS_P=triton.next_power_of_2(num_heads),
                                HALF_P=triton.next_power_of_2(half))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1. + tl.exp(-g))).to(dtype)  # torch rounds silu(gate) before the multiply
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> [T, I]: silu(gate) * up."""
    num_tokens, width = gate_up.shape
    assert gate_up.stride(-1) == 1 and width % 2 == 0
    inter = width // 2
    out = gate_up.new_empty(num_tokens, inter)
    if num_tokens:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                  INTER=inter, BLOCK=block)
    return out
