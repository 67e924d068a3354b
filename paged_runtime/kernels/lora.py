"""LoRA kernels (punica's BGMV): each row's adapter delta, added to a layer's output in place.

A layer's slots hold ``a`` [S, N*R, in] (the N parts' A stacked by rank rows: part i's at rows i*R ..) and
``b`` [S, out, R]; row t runs slot ``row_slots[t]`` (-1: the base model, whose programs return at once).

- shrink: u[t] = A[slot] @ x[t], all N*R ranks, fp32 sums rounded to the model dtype (``F.linear``'s rounding).
  Grid (T, N*R / BLOCK_R), a loop over ``in`` by BLOCK_K.
- expand: y[t, cols] += B[slot, cols] @ u[t, part(col) ranks], the delta rounded to the model dtype before the
  add, as ``TorchOps.lora_delta`` rounds. Grid (T, out / BLOCK_N), all R ranks in one tile; an output block may
  straddle parts, so each column finds its part from the parts' ends (constexpr: a layer's widths are fixed).

Each program reads its row's slot on the device and the grids depend only on T, in, out and R, so a CUDA graph
captures both launches with the slot table as an input (no host read of ``row_slots``). One row a program:
weights are re-read per row (from L2 when rows share a slot); no tensor cores.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

SHRINK_BLOCK_R = 16
SHRINK_BLOCK_K = 256
EXPAND_TILE = 4096  # elements of an expand program's B tile: BLOCK_N * R_P (keeps large ranks in registers)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, u_ptr, slots_ptr, stride_x, stride_a_slot, stride_a_rank, stride_u,
                   IN: tl.constexpr, RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < RANKS
    a_rows = a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < IN, other=0.).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=rank_ok[:, None] & (k[None, :] < IN), other=0.).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(u_ptr + row * stride_u + ranks, acc.to(u_ptr.dtype.element_ty), mask=rank_ok)


@triton.jit
def _expand_kernel(u_ptr, b_ptr, y_ptr, slots_ptr, stride_u, stride_b_slot, stride_b_out, stride_y,
                   OUT: tl.constexpr, RANK: tl.constexpr, PART_ENDS: tl.constexpr, NUM_PARTS: tl.constexpr,
                   BLOCK_N: tl.constexpr, RANK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < OUT
    part = tl.zeros([BLOCK_N], tl.int32)
    for i in tl.static_range(NUM_PARTS - 1):  # the last part's end is OUT
        part += (cols >= PART_ENDS[i]).to(tl.int32)
    r = tl.arange(0, RANK_P)
    mask = col_ok[:, None] & (r[None, :] < RANK)
    u = tl.load(u_ptr + row * stride_u + part[:, None] * RANK + r[None, :], mask=mask, other=0.)
    b = tl.load(b_ptr + slot * stride_b_slot + cols[:, None] * stride_b_out + r[None, :], mask=mask, other=0.)
    delta = tl.sum(b.to(tl.float32) * u.to(tl.float32), axis=1)
    y_row = y_ptr + row * stride_y + cols
    y = tl.load(y_row, mask=col_ok, other=0.)
    dtype = y.dtype
    # torch rounds the part's product, then the sum (F.linear, then index_add_).
    tl.store(y_row, (y.to(tl.float32) + delta.to(dtype).to(tl.float32)).to(dtype), mask=col_ok)


def lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
               slices: tuple[int, ...] | list[int]) -> None:
    """As ``TorchOps.lora_delta``: y [T, out] += each row's B_s (A_s x_t), in place (rows of slot -1 untouched).
    x [T, in] and y may have strided rows, their last dim contiguous; ``a`` / ``b`` rows contiguous."""
    num_tokens, in_size = x.shape
    out_size, rank = b.shape[1:]
    num_parts = len(slices)
    assert y.shape == (num_tokens, out_size) and a.shape[1:] == (num_parts * rank, in_size)
    assert sum(slices) == out_size and row_slots.shape == (num_tokens,)
    assert x.stride(-1) == y.stride(-1) == a.stride(-1) == b.stride(-1) == 1
    if num_tokens == 0:
        return
    # Both grids come from shapes alone: no host read of row_slots, so CUDA graphs capture the launches.
    u = x.new_empty(num_tokens, num_parts * rank)  # rows of slot -1 stay unwritten: expand skips them too
    block_r = min(SHRINK_BLOCK_R, triton.next_power_of_2(num_parts * rank))
    _shrink_kernel[(num_tokens, triton.cdiv(num_parts * rank, block_r))](
        x, a, u, row_slots, x.stride(0), a.stride(0), a.stride(1), u.stride(0),
        IN=in_size, RANKS=num_parts * rank, BLOCK_R=block_r,
        BLOCK_K=min(SHRINK_BLOCK_K, triton.next_power_of_2(in_size)))
    rank_p = triton.next_power_of_2(rank)
    block_n = min(max(16, EXPAND_TILE // rank_p), triton.next_power_of_2(out_size))
    ends = tuple(itertools.accumulate(int(w) for w in slices))  # host ints: the layer's fixed widths
    _expand_kernel[(num_tokens, triton.cdiv(out_size, block_n))](
        u, b, y, row_slots, u.stride(0), b.stride(0), b.stride(1), y.stride(0),
        OUT=out_size, RANK=rank, PART_ENDS=ends, NUM_PARTS=num_parts, BLOCK_N=block_n, RANK_P=rank_p)
