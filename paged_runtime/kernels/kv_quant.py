"""The paged KV cache in another dtype than the model's (``--kv-cache-dtype``): the plain-torch reference of
storing and reading it.

Values keep the cache layout ``[num_slots, 2, num_kv_heads, head_dim]`` (a slot's key at ``[slot, 0]``, its
value at ``[slot, 1]``) in an 8-bit dtype or bfloat16; each layer's ``kv_scale`` says how to read them back:

- ``fp8`` / ``fp8_e4m3`` (vLLM's flag): torch.float8_e4m3fn values, ``kv_scale`` float32 ``[2]`` = (k_scale,
  v_scale), per tensor, 1.0 unless set (vLLM's default when the checkpoint has none). Stored: x / scale,
  saturated to +-448 (e4m3's largest finite), rounded to nearest even; read: value * scale.
- ``int8``: symmetric per token and KV head: ``kv_scale`` float32 ``[num_slots, 2, num_kv_heads]`` beside the
  values (absmax / 127 of that head's row); stored: round(x / scale) (nearest even, in [-127, 127]); read:
  value * scale, so |x - read| <= scale / 2. An all-zero row has scale 0 and reads back 0. Read in a
  model dtype narrower than float32, the scale is first rounded to that dtype (value times it is then exact
  in float32, rounded once to the dtype): two cheap passes over the context instead of three in float32.
- ``bfloat16`` under float32 activations (half the bytes, as llama.cpp's f16 cache): ``kv_scale`` None;
  stored: x rounded to bfloat16 (nearest even, torch's cast); read: widened to float32, exactly. Under bfloat16
  activations it is the model's own dtype (as ``auto``); under float16 refused (fewer fraction bits than the
  model's, no bytes saved).
- ``auto``: the model's dtype, ``kv_scale`` None (no conversion).

A cache in another dtype than the model's is read back from the cache by every query, a whole prompt's
included, so each query sees the values a later prefix-cache hit will see.

Arithmetic in float32 from the K/V as the model produced them (so the C kernels and Triton, which do the
same, store bit-identical caches). The compiled kernels (``cpu_ops.c``) and Triton (``store_kv.py``,
``attention.py``; 8 bits only: the worker refuses a bfloat16 cache under float32 there) implement this same
contract.
"""
from __future__ import annotations

import torch

from paged_runtime.kernels import cpu

# --kv-cache-dtype name -> the cache's element dtype (auto: the model's).
CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                                               "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
SCALE_DTYPE = torch.float32


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a ``name`` cache for a model computing in ``model_dtype``."""
    if name not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(CACHE_DTYPES)}; got {name!r}")
    if name == "bfloat16" and model_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kv_cache_dtype bfloat16 needs float32 or bfloat16 activations, not {model_dtype}")
    return CACHE_DTYPES[name] or model_dtype


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in (torch.float8_e4m3fn, torch.int8)


def bytes_per_token_head(name: str, model_dtype: torch.dtype, head_dim: int) -> int:
    """One token's K and V bytes for one KV head: values plus int8's two float32 scales."""
    dtype = cache_dtype(name, model_dtype)
    scales = 2 * SCALE_DTYPE.itemsize if dtype == torch.int8 else 0
    return 2 * head_dim * dtype.itemsize + scales


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` to copy and index: fp8 as its uint8 bits (PyTorch's CPU index_copy_ / index_select / indexed
    assignment have no float8 kernels), anything else as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def copy_slots(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write: slots ``src`` of each slot-indexed tensor (caches, int8 scales) into slots ``dst``."""
    for t in tensors:
        t = as_bytes(t)
        t[dst] = t[src]


def allocate_scale(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """The scale tensor that goes with a fresh (zeroed) cache: fp8 (1.0, 1.0); int8 zeros per slot and head."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        return torch.ones(2, dtype=SCALE_DTYPE, device=kv_cache.device)
    if kv_cache.dtype == torch.int8:
        return torch.zeros(kv_cache.shape[:3], dtype=SCALE_DTYPE, device=kv_cache.device)
    return None


def quantize(kv: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None):
    """``kv`` ``[T, 2, Hkv, D]`` -> (values in the cache's dtype, int8's ``[T, 2, Hkv]`` scales or None)."""
    if not is_quantized(kv_cache):
        return kv.to(kv_cache.dtype), None
    x = kv.float()
    if kv_cache.dtype == torch.float8_e4m3fn:
        return (x / kv_scale.view(1, 2, 1, 1)).clamp(-FP8_MAX, FP8_MAX).to(kv_cache.dtype), None
    scale = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
          slot_mapping: torch.Tensor) -> None:
    """Write k / v ``[T, Hkv, D]`` into slots ``slot_mapping`` ``[T]``, quantizing for an 8-bit cache."""
    values, scales = quantize(torch.stack((k, v), dim=1), kv_cache, kv_scale)
    as_bytes(kv_cache).index_copy_(0, slot_mapping, as_bytes(values))
    if scales is not None:
        kv_scale.index_copy_(0, slot_mapping, scales)


def dequantize(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., 2, Hkv, D]`` read back in ``dtype``: fp8's ``scales`` are (k, v) ``[2]``, int8's the
    rows' own ``[..., 2, Hkv]``."""
    if values.dtype == torch.float8_e4m3fn:
        return (values.float() * scales.view(2, 1, 1)).to(dtype)
    if values.dtype == torch.int8:  # an int8 value is exact in any float dtype; scales rounded to it first
        return values.to(dtype) * scales.to(dtype)[..., None]
    return values


def gather(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, slots: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """Slots ``slots`` (1-D) of the cache, ``[N, 2, Hkv, D]`` in ``dtype``. fp8 with ``kv_scale`` None: the e4m3
    values as they are (exact in any float dtype), for a caller that applies (k_scale, v_scale) itself."""
    if not is_quantized(kv_cache):
        return kv_cache.index_select(0, slots).to(dtype)  # bfloat16 under float32: widened, exact
    if kv_cache.device.type == "cpu" and dtype in cpu.DTYPES and cpu.loaded():
        return cpu.cpu_kv_gather(kv_cache, kv_scale, slots, dtype)  # the same values, in one pass
    values = as_bytes(kv_cache).index_select(0, slots).view(kv_cache.dtype)
    if kv_scale is None and kv_cache.dtype == torch.float8_e4m3fn:
        return values.to(dtype)
    scales = kv_scale.index_select(0, slots) if kv_cache.dtype == torch.int8 else kv_scale
    return dequantize(values, scales, dtype)
