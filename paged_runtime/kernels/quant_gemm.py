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

- GGUF blocks (``layers/quantization/gguf.py``; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): the file's
  bytes as they are, ``[N, row_bytes]`` uint8. Each tile element finds its block, its quant (nibble, high bits)
  and its scales and mins, and computes ``gguf_blocks.dequantize``'s float32 value with its operations in its
  order (no fused multiply-add: ``enable_fp_fusion=False``), rounded to the activations' dtype for the dot.

Grid (M / BLOCK_M, N / BLOCK_N, splits), a loop over the split's share of K; fp32 accumulators; float32 dots are
"ieee" (no TF32), so float32 agrees with the dequantize + ``F.linear`` reference to summation order. Two regimes:

- large M (prefill): one split, the output rounded once to x's dtype in the kernel;
- small M (decode): (M, N) tiles too few to give every SM two programs (``split_k``) split K as well, so the
  whole device streams the weight: each split writes its fp32 partial sums to ``[splits, M, N]`` and one sum over
  the splits (a fixed order: deterministic, no atomics, capturable in CUDA graphs) rounds them to x's dtype.

The tile shape and the split rule are first guesses; their tuning needs a GPU (issue 36).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_runtime.kernels.attention import sm_count
from paged_runtime.kernels.gguf_types import gguf_type
from paged_runtime.kernels.gguf_types import row_bytes as gguf_row_bytes

GROUP = 128  # int4's group of input features (int4.GROUP_SIZE)
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # tl.dot needs 16 on each side; BLOCK_K divides GROUP
PROGRAMS_PER_SM = 2  # programs the (M, N, split) grid aims at per streaming multiprocessor
MIN_SPLIT_TILES = 4  # K tiles a split covers at least: fewer and the partial sums cost more than they spread


@triton.jit
def _x_tile(x_ptr, rows, row_ok, ks, k_ok, stride_x):
    """x[rows, ks], zeros outside x."""
    return tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                   other=0.)


@triton.jit
def _k_range(K, K_SPLIT):
    """The first and end K of this program's split (program_id 2): K_SPLIT inputs each, the last one short."""
    k_start = tl.program_id(2) * K_SPLIT
    return k_start, tl.minimum(K, k_start + K_SPLIT)


@triton.jit
def _store_out(out_ptr, acc, rows, row_ok, cols, col_ok, stride_out, stride_split):
    """out[split, rows, cols] = acc, rounded once to out's dtype (fp32 partial sums where K is split)."""
    at = out_ptr + tl.program_id(2).to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w8a16_kernel(x_ptr, out_ptr, M, N, K, K_SPLIT, stride_x, stride_out, stride_split, q_ptr, scale_ptr, stride_q,
                  DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start, k_end = _k_range(K, K_SPLIT)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = _x_tile(x_ptr, rows, row_ok, ks, k_ok, stride_x)
        q = tl.load(q_ptr + cols[None, :].to(tl.int64) * stride_q + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0)  # [BLOCK_K, BLOCK_N]: W.T's tile
        acc += tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.).to(tl.float32)
    out = acc * scale[None, :]
    _store_out(out_ptr, out, rows, row_ok, cols, col_ok, stride_out, stride_split)


@triton.jit
def _w4a16_kernel(x_ptr, out_ptr, M, N, K, K_SPLIT, stride_x, stride_out, stride_split, q_ptr, sz_ptr, stride_q,
                  stride_sz_group,
                  DOT_PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start, k_end = _k_range(K, K_SPLIT)
    for k0 in range(k_start, k_end, BLOCK_K):  # K: the padded width, a whole number of groups
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
    _store_out(out_ptr, acc, rows, row_ok, cols, col_ok, stride_out, stride_split)


@triton.jit
def _f16_at(p, mask):
    """The little-endian float16 at byte p, as float32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_tile(q_ptr, cols, ks, mask, row_bytes, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """W[cols, ks].T as float32 [BLOCK_K, BLOCK_N], each weight gguf_blocks.dequantize's value."""
    row = q_ptr + cols[None, :].to(tl.int64) * row_bytes
    if QTYPE == 8:  # Q8_0: d, 32 int8
        blk = row + (ks // 32 * BLOCK_BYTES)[:, None]
        q = tl.load(blk + 2 + (ks % 32)[:, None], mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _f16_at(blk, mask)
    elif QTYPE <= 7:  # Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7): d[, m][, qh (4)], then 16 bytes of nibbles
        j = (ks % 32)[:, None]
        blk = row + (ks // 32 * BLOCK_BYTES)[:, None]
        byte = tl.load(blk + BLOCK_BYTES - 16 + j % 16, mask=mask, other=0).to(tl.int32)
        q = tl.where(j < 16, byte & 0xF, byte >> 4)
        if QTYPE >= 6:  # the fifth bits: element j's is bit j of the 4 bytes before the nibbles
            qh = tl.load(blk + BLOCK_BYTES - 20 + j // 8, mask=mask, other=0).to(tl.int32)
            q = q | (((qh >> (j % 8)) & 1) << 4)
        d = _f16_at(blk, mask)
        if QTYPE % 2 == 1:  # Q4_1, Q5_1: a min
            w = d * q.to(tl.float32) + _f16_at(blk + 2, mask)
        elif QTYPE == 2:
            w = d * (q - 8).to(tl.float32)
        else:
            w = d * (q - 16).to(tl.float32)
    elif QTYPE == 14:  # Q6_K: ql (128), qh (64), 16 int8 scales, d
        j = (ks % 256)[:, None]
        blk = row + (ks // 256 * BLOCK_BYTES)[:, None]
        half, i = j // 128, j % 128
        low = tl.load(blk + 64 * half + i % 64, mask=mask, other=0).to(tl.int32)
        low = tl.where(i < 64, low & 0xF, low >> 4)
        high = (tl.load(blk + 128 + 32 * half + i % 32, mask=mask, other=0).to(tl.int32) >> (2 * (i // 32))) & 3
        sc = tl.load(blk + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_f16_at(blk + 208, mask) * sc) * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # Q4_K (12), Q5_K (13): d, dmin, 12 bytes of 6-bit scales and mins[, qh (32)], then 128 bytes of nibbles
        j = (ks % 256)[:, None]
        blk = row + (ks // 256 * BLOCK_BYTES)[:, None]
        sub = j // 32
        byte = tl.load(blk + BLOCK_BYTES - 128 + 32 * (j // 64) + j % 32, mask=mask, other=0).to(tl.int32)
        q = tl.where(sub % 2 == 0, byte & 0xF, byte >> 4)
        if QTYPE == 13:
            q = q | (((tl.load(blk + 16 + j % 32, mask=mask, other=0).to(tl.int32) >> sub) & 1) << 4)
        # gguf_blocks._k_scales: sub-block s < 4 has its scale in byte 4 + s and its min in 8 + s (6 bits each);
        # s >= 4 has them in the low / high nibble of byte 12 + s - 4, topped by the top two bits of 4 + s - 4 /
        # 8 + s - 4. All three bytes are loaded for every s (each lies in the block) and tl.where picks.
        lo4 = tl.load(blk + 4 + sub % 4, mask=mask, other=0).to(tl.int32)  # d: bytes 4-7
        mid = tl.load(blk + 8 + sub % 4, mask=mask, other=0).to(tl.int32)  # m: bytes 8-11
        top = tl.load(blk + 12 + sub % 4, mask=mask, other=0).to(tl.int32)  # md: bytes 12-15
        sc = tl.where(sub < 4, lo4 & 0x3F, (top & 0x0F) | ((lo4 >> 2) & 0x30)).to(tl.float32)
        mn = tl.where(sub < 4, mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)).to(tl.float32)
        w = (_f16_at(blk, mask) * sc) * q.to(tl.float32) - _f16_at(blk + 2, mask) * mn
    return w


@triton.jit
def _gguf_kernel(x_ptr, out_ptr, M, N, K, K_SPLIT, stride_x, stride_out, stride_split, q_ptr, row_bytes,
                 QTYPE: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start, k_end = _k_range(K, K_SPLIT)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = _x_tile(x_ptr, rows, row_ok, ks, k_ok, stride_x)
        w = _gguf_tile(q_ptr, cols, ks, col_ok[None, :] & k_ok[:, None], row_bytes, QTYPE, BLOCK_BYTES)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    _store_out(out_ptr, acc, rows, row_ok, cols, col_ok, stride_out, stride_split)


def split_k(m: int, n: int, k: int, sms: int) -> int:
    """K splits for an [m, k] @ [k, n] product on a device of ``sms`` SMs: 1 where the (M, N) tiles already give
    every SM ``PROGRAMS_PER_SM`` programs (prefill), else as many as make up the difference (decode), each split
    covering at least ``MIN_SPLIT_TILES`` K tiles."""
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, tiles), triton.cdiv(k, BLOCK_K) // MIN_SPLIT_TILES))


def _launch(kernel, x: torch.Tensor, n: int, k: int, weight: tuple, split: int | None, **meta) -> torch.Tensor:
    """x [M, K] through ``kernel`` (its arguments: x, out, M, N, K, K_SPLIT, the three strides, then ``weight``'s)
    -> [M, N] in x's dtype; ``split``: K splits (default ``split_k``'s), fewer where K has fewer tiles."""
    m = x.shape[0]
    if not m:
        return x.new_empty(0, n)
    split = split or split_k(m, n, k, sm_count())
    k_split = triton.cdiv(triton.cdiv(k, BLOCK_K), split) * BLOCK_K  # whole K tiles: an int4 group stays in one
    splits = triton.cdiv(k, k_split)
    out = x.new_empty(m, n) if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)](
        x, out, m, n, k, k_split, x.stride(0), out.stride(-2), out.stride(0) if splits > 1 else 0, *weight,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        **meta)
    return out if splits == 1 else out.sum(0).to(x.dtype)


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ (qweight * scale[:, None]).T -> [M, N] in x's dtype."""
    return _launch(_w8a16_kernel, x, qweight.shape[0], x.shape[1], (qweight, scale, qweight.stride(0)), split)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor,
                 split: int | None = None) -> torch.Tensor:
    """x [M, K] @ the int4 weight's transpose -> [M, N] in x's dtype; x is zero-padded to the groups' width here,
    as ``Int4LinearMethod`` pads it for torch's kernel."""
    k, padded = x.shape[1], qweight.shape[1] * 2
    if k != padded:
        x = torch.nn.functional.pad(x, (0, padded - k))
    weight = (qweight, scales_and_zeros, qweight.stride(0), scales_and_zeros.stride(0))
    return _launch(_w4a16_kernel, x, qweight.shape[0], padded, weight, split, GROUP=GROUP)


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int, split: int | None = None) -> torch.Tensor:
    """x [M, K] @ the GGUF weight's transpose -> [M, N] in x's dtype; raw: [N, row_bytes] uint8, the file's
    blocks of ggml type id ``qtype`` (a served one: ``kernels.gguf_types``)."""
    k = x.shape[1]
    n, row_bytes = raw.shape
    t = gguf_type(qtype)
    if row_bytes != gguf_row_bytes(t, k):
        raise ValueError(f"{t.name} rows of {k} inputs take {gguf_row_bytes(t, k)} bytes, not {row_bytes}")
    return _launch(_gguf_kernel, x, n, k, (raw, row_bytes), split, QTYPE=t.id, BLOCK_BYTES=t.block_bytes,
                   enable_fp_fusion=False)
