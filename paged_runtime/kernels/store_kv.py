"""Store kernel: write a step's new K and V into the paged cache.

Cache layout per layer: ``[num_slots, 2, num_kv_heads, head_dim]`` (``num_slots
= num_blocks * block_size``), a slot's key at ``[slot, 0]`` and value at
``[slot, 1]``. Token ``t``'s K/V go to slot ``slot_mapping[t]``; slot -1 marks a
padding token, whose K/V are not stored.

Grid: one program per token, each moving all of that token's KV heads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_c_slot, stride_c_kv, stride_c_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * stride overflows int32 in big caches
    if slot < 0:
        return
    head = tl.arange(0, HEADS_P)[:, None]
    dim = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (head < NUM_KV_HEADS) & (dim < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_t + head * stride_k_h + dim, mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + head * stride_v_h + dim, mask=mask)
    dst = cache_ptr + slot * stride_c_slot + head * stride_c_h + dim
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: ``[T, num_kv_heads, head_dim]`` (rows may be strided, the head dim contiguous);
    slot_mapping: ``[T]`` integer slots, -1 for padding tokens."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and kv_cache.shape[1:] == (2, num_kv_heads, head_dim)
    assert k.stride(-1) == v.stride(-1) == kv_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim),
    )
