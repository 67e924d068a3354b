"""Store kernel: write a step's new K and V into the paged cache.

Cache layout per layer: ``[num_slots, 2, num_kv_heads, head_dim]`` (``num_slots
= num_blocks * block_size``), a slot's key at ``[slot, 0]`` and value at
``[slot, 1]``. Token ``t``'s K/V go to slot ``slot_mapping[t]``; slot -1 marks a
padding token, whose K/V are not stored.

An 8-bit cache (``kernels.kv_quant``) is quantized here: fp8 divides by the layer's (k_scale, v_scale),
saturates to +-448 and rounds to nearest even; int8 writes each head's absmax / 127 to the scale tensor
``[num_slots, 2, num_kv_heads]`` and round(x / scale) to the cache.

Grid: one program per token, each moving all of that token's KV heads.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from paged_runtime.kernels import kv_quant


# Adding then subtracting 1.5 * 2^23 rounds an fp32 of magnitude < 2^22 to the nearest integer, ties to even
# (fp32's own rounding), as torch.round does; no rint needed (the interpreter lacks libdevice). A tl.constexpr:
# the compiler refuses any other global (the interpreter does not; tests/kernels/test_compiles_for_gpus.py).
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, so the fp8 cast that follows is
    exact (the interpreter's own cast drops a carry into the exponent: 0.49 became 0.25). Normals keep 3
    mantissa bits (round at bit 20 of the fp32 pattern); below 2^-6 (subnormals) steps of 2^-9."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = ((tl.abs(x) * 512.0 + _ROUND_MAGIC) - _ROUND_MAGIC) / 512.0
    subnormal = tl.where(x < 0, -subnormal, subnormal)  # keeps the sign of a zero, as torch's cast
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _e4m3_bits(x):
    """The e4m3 bit pattern (uint8) of an fp32 that is an e4m3 value already (``_round_to_e4m3``'s): the sign,
    4 exponent bits biased by 7 and 3 mantissa bits; below 2^-6 the subnormals, m * 2^-9 (a zero keeps its
    sign, as torch's cast). For a GPU whose Triton has no float8_e4m3fn (``fp8_native``)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    size = tl.abs(x)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    subnormal = (size * 512.0).to(tl.int32)  # exact: a multiple of 2^-9 below 2^-6
    return (sign | tl.where(size < 0.015625, subnormal, normal)).to(tl.uint8)


@triton.jit
def _quantize(x, scale_ptr, slot, stride_s_slot, stride_s_kv, KV: tl.constexpr, head, head_ok,
              QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """x [HEADS_P, HEAD_DIM_P] (K if KV == 0, else V) in the cache's terms; int8 also stores its scales."""
    x = x.to(tl.float32)
    if QUANT == 1 or QUANT == 3:  # fp8: per-tensor scale
        x = x / tl.load(scale_ptr + KV)
        x = _round_to_e4m3(tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX))
        if QUANT == 3:  # the bits as a number (every return is fp32): the store's cast to uint8 keeps them
            x = _e4m3_bits(x).to(tl.float32)
        return x
    scale = tl.max(tl.abs(x), axis=1) / 127.0  # int8: per head
    tl.store(scale_ptr + slot * stride_s_slot + KV * stride_s_kv + head, scale, mask=head_ok)
    safe = tl.where(scale > 0, scale, 1.0)
    q = (x / safe[:, None] + _ROUND_MAGIC) - _ROUND_MAGIC
    return tl.minimum(tl.maximum(q, -127.0), 127.0)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr, scale_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_c_slot, stride_c_kv, stride_c_h, stride_s_slot, stride_s_kv,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * stride overflows int32 in big caches
    if slot < 0:
        return
    head = tl.arange(0, HEADS_P)[:, None]
    dim = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (head < NUM_KV_HEADS) & (dim < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_t + head * stride_k_h + dim, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_v_t + head * stride_v_h + dim, mask=mask, other=0.0)
    if QUANT:
        heads = tl.arange(0, HEADS_P)
        k = _quantize(k, scale_ptr, slot, stride_s_slot, stride_s_kv, 0, heads, heads < NUM_KV_HEADS, QUANT, FP8_MAX)
        v = _quantize(v, scale_ptr, slot, stride_s_slot, stride_s_kv, 1, heads, heads < NUM_KV_HEADS, QUANT, FP8_MAX)
    dst = cache_ptr + slot * stride_c_slot + head * stride_c_h + dim
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@functools.cache
def fp8_native(device: torch.device) -> bool:
    """Whether Triton loads and stores float8_e4m3fn on ``device``: a GPU of compute capability 8.9 on (Ada,
    Hopper) and the interpreter; not Ampere (sm_80 / sm_86), where an fp8 cache goes through the kernels as its
    bits (QUANT 3), the same values."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def quant_mode(kv_cache: torch.Tensor) -> int:
    """The kernels' QUANT constant: 0 the model's dtype, 1 fp8 (per-tensor scales), 2 int8 (per token and head),
    3 fp8 as its e4m3 bits (uint8), where Triton has no float8_e4m3fn (``fp8_native``)."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        return 1 if fp8_native(kv_cache.device) else 3
    return 2 if kv_cache.dtype == torch.int8 else 0


def kernel_view(kv_cache: torch.Tensor, quant: int) -> torch.Tensor:
    """The cache as the kernels take it: an fp8 one as uint8 bits under QUANT 3 (same bytes, no copy)."""
    return kv_cache.view(torch.uint8) if quant == 3 else kv_cache


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """k, v: ``[T, num_kv_heads, head_dim]`` (rows may be strided, the head dim contiguous);
    slot_mapping: ``[T]`` integer slots, -1 for padding tokens; ``kv_scale``: an 8-bit cache's scales."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and kv_cache.shape[1:] == (2, num_kv_heads, head_dim)
    assert k.stride(-1) == v.stride(-1) == kv_cache.stride(-1) == 1
    quant = quant_mode(kv_cache)
    assert (kv_scale is not None) == bool(quant), "an 8-bit cache needs its scales, a model-dtype one none"
    if num_tokens == 0:
        return
    scale = kv_scale if quant else kv_cache
    per_slot = quant == 2
    _store_kv_kernel[(num_tokens,)](
        k, v, kernel_view(kv_cache, quant), slot_mapping, scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        scale.stride(0) if per_slot else 0, scale.stride(1) if per_slot else 0,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim),
        QUANT=quant, FP8_MAX=kv_quant.FP8_MAX,
    )
