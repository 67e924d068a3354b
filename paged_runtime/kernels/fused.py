"""Fused element-wise kernels of a decoder layer: one launch each where plain PyTorch takes several.

- ``add_rms_norm``: ``residual + x`` (rounded to the model dtype, returned as the new residual) and
  RMSNorm of it, Llama's numerics: the sum of squares in fp32, the normalised row rounded to the
  model dtype before it is multiplied by the weight (as ``TorchOps.rms_norm``). Without a residual,
  the norm alone. PyTorch: an add, a cast, a square, a mean, an rsqrt, two multiplies and casts.
- ``rope_``: rotate-half RoPE in place over the first ``num_heads`` heads of each row of a fused qkv
  (q's heads then k's heads are adjacent), cos / sin read from the fp32 tables at each token's
  position and rounded to the model dtype first (as ``TorchOps.rope_inputs``). PyTorch: an index,
  casts, a split, two cats, four multiplies and adds, for q and again for k.
- ``silu_mul``: ``silu(gate) * up`` of a ``[T, 2I]`` gate/up row block into ``[T, I]``, the SiLU rounded
  to the model dtype before the product (as PyTorch's two ops).

Arithmetic is fp32 inside every kernel (Triton's CPU interpreter computes bfloat16 wrongly, and on
the GPU it costs nothing here): in float32 the results equal ``TorchOps``' up to the order of the
norm's sum. Grids depend on shapes only (no device reads): CUDA graphs capture them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                         stride_x, stride_r, stride_o, stride_ro, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < HIDDEN
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = h + tl.load(residual_ptr + row * stride_r + col, mask=mask, other=0.0).to(tl.float32)
        h = h.to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + col, h, mask=mask)
        h = h.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / HIDDEN
    normed = (h * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, (weight * normed).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x) for ``[T, hidden]`` rows; with no residual, (norm(x), x)."""
    assert x.stride(-1) == 1 and weight.is_contiguous()
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if num_rows:
        r = residual if residual is not None else x
        _add_rms_norm_kernel[(num_rows,)](
            x, r, weight, out, residual_out, eps, x.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
            HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None)
    return out, residual_out


@triton.jit
def _rope_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, stride_t, stride_pos,
                 HEAD_DIM: tl.constexpr, HALF_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    dim = tl.arange(0, HALF_P)
    mask = dim < half
    dtype = qkv_ptr.dtype.element_ty
    position = tl.load(positions_ptr + token).to(tl.int64)
    table = position * stride_pos + dim
    # The tables rounded to the model dtype first, as TorchOps.rope_inputs.
    cos1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + half, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + half, mask=mask, other=0.0).to(dtype).to(tl.float32)
    base = qkv_ptr + token * stride_t + head * HEAD_DIM + dim
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
    tl.store(base + half, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)


def rope_(qkv: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate, in place, heads 0 .. num_heads - 1 of each ``[T, *]`` row (whole heads: the tables are
    ``[max_position, head_dim]``, cat(freqs, freqs) as rotate-half RoPE lays them out)."""
    assert qkv.stride(-1) == 1 and cos.shape[-1] == head_dim and head_dim % 2 == 0
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
    if qkv.shape[0]:
        _rope_kernel[(qkv.shape[0], num_heads)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0),
                                                HEAD_DIM=head_dim, HALF_P=triton.next_power_of_2(head_dim // 2))


SILU_BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < WIDTH
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + WIDTH + col, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + col, (silu * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate columns, then up columns) -> ``[T, I]``."""
    assert gate_up.stride(-1) == 1
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_rows, width)
    block = min(SILU_BLOCK, triton.next_power_of_2(width))
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                WIDTH=width, BLOCK=block)
    return out
