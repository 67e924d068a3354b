"""Weight-only quantized GEMMs in Triton: out[M, N] = x[M, K] @ W.T with W's integers dequantized in registers,
tile by tile, inside the product (no dequantized copy of the matrix, which CUDA otherwise made on every call).

- W8A16 (``layers/quantization/int8.py``): ``qweight`` int8 [N, K], ``scale`` [N]. The integer tiles go into the
  dot in the activations' dtype (int8 values are exact in fp16 / bf16 / fp32) and the per-channel scale is applied
  to the fp32 sums once at the end.
- W4A16 (``layers/quantization/int4.py``; GPTQ / AWQ / compressed-tensors checkpoints are stored in the same
  layout at load): ``qweight`` uint8 [N, K_padded / 2], column 2j in the low nibble, 2j + 1 in the high, and
  ``scales_and_zeros`` [K_padded / 128, N, 2]: code q stands for ``(q - 8) * scale + zero``. A K tile lies in one
  group of 128 (BLOCK_K divides it), so each tile dequantizes with one scale and zero per output row, in fp32,
  rounded to the activations' dtype for the dot as ``dequantize_int4`` rounds.

Grid (M / BLOCK_M, N / BLOCK_N), a loop over K; fp32 accumulators; the output rounded once to x's dtype. float32
dots are "ieee" (no TF32), so float32 agrees with the dequantize + ``F.linear`` reference to summation order.
One tile shape for every M for now: the small-M (split-K, weight-streaming) and large-M tunings need a GPU to be
measured (issue 36).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128  # int4's group of input features (int4.GROUP_SIZE)
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # tl.dot needs 16 on each side; BLOCK_K divides GROUP


@triton.jit
def _w8a16_kernel(x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, stride_x, stride_q, stride_out,
                  DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.)
        q = tl.load(q_ptr + cols[None, :].to(tl.int64) * stride_q + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0)  # [BLOCK_K, BLOCK_N]: W.T's tile
        acc += tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w4a16_kernel(x_ptr, q_ptr, sz_ptr, out_ptr, M, N, K, stride_x, stride_q, stride_out, stride_sz_group,
                  DOT_PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K: the padded width, a whole number of groups
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None], other=0.)
        packed = tl.load(q_ptr + cols[None, :].to(tl.int64) * stride_q + (ks // 2)[:, None],
                         mask=col_ok[None, :], other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N], each byte twice
        codes = (packed >> ((ks % 2) * 4)[:, None]) & 0xF
        sz = sz_ptr + (k0 // GROUP) * stride_sz_group + cols * 2
        scale = tl.load(sz, mask=col_ok, other=0.).to(tl.float32)
        zero = tl.load(sz + 1, mask=col_ok, other=0.).to(tl.float32)
        w = ((codes - 8).to(tl.float32) * scale[None, :] + zero[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


def _precision(x: torch.Tensor) -> str | None:
    return "ieee" if x.dtype == torch.float32 else None


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ (qweight * scale[:, None]).T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    out = x.new_empty(m, n)
    if m:
        _w8a16_kernel[_grid(m, n)](x, qweight, scale, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
                                   DOT_PRECISION=_precision(x), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the int4 weight's transpose -> [M, N] in x's dtype; x is zero-padded to the groups' width here,
    as ``Int4LinearMethod`` pads it for torch's kernel."""
    m, k = x.shape
    n, padded = qweight.shape[0], qweight.shape[1] * 2
    if k != padded:
        x = torch.nn.functional.pad(x, (0, padded - k))
    out = x.new_empty(m, n)
    if m:
        _w4a16_kernel[_grid(m, n)](x, qweight, scales_and_zeros, out, m, n, padded, x.stride(0), qweight.stride(0),
                                   out.stride(0), scales_and_zeros.stride(0), DOT_PRECISION=_precision(x),
                                   GROUP=GROUP, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
