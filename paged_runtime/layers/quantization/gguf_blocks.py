"""GGUF block formats in plain torch: the definition of each served type and the oracle for the C kernels.

A GGUF weight is a uint8 tensor ``[N, row_bytes]``: row n holds the K inputs of output n as K / block_elems
blocks of block_bytes each, exactly the file's bytes. ``dequantize(raw, type, dtype)`` turns it into
``[N, K]`` on any device (the CUDA path multiplies by that; the CPU path uses the compiled kernels where
they load). The arithmetic is float32 in llama.cpp's order (scale x sub-scale first, then x q, minus the
min), so the result equals ``gguf.quants.dequantize`` bit for bit before the final cast.
"""
from __future__ import annotations

import torch

from paged_runtime.kernels.gguf_types import GGUF_TYPES, GgufType, gguf_type


# The block types served as they are (what Q4_0 / Q4_1 / Q5_x / Q8_0 / Q4_K_M / Q5_K_M / Q6_K files hold).
SERVED = GGUF_TYPES
_QK_K = 256


def served_type(name_or_id: str | int) -> GgufType:
    """The served type of that name or id; ValueError naming it and listing the served ones."""
    try:
        return gguf_type(name_or_id)
    except ValueError:
        raise ValueError(f"GGUF tensor type {name_or_id} is not served quantized; served types: "
                         f"{', '.join(SERVED)} (--quantization none dequantizes any type at load)") from None


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [..., 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """[..., width] bytes -> [..., 2 * width]: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(b[:, :2]), b[:, 2:]
    return d * (_nibbles(qs, 16).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:]
    return d * _nibbles(qs, 16).float() + m


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: 4 bytes (a little-endian uint32) -> the 32 fifth bits, element i from bit i, as 16s."""
    bits = (qh.reshape(-1, 4, 1) >> torch.arange(8, dtype=torch.uint8, device=qh.device)) & 1
    return bits.reshape(-1, 32) << 4


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(b[:, :2]), _nibbles(b[:, 6:], 16) | _high_bits(b[:, 2:6])
    return d * (qs.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * (_nibbles(b[:, 8:], 16) | _high_bits(b[:, 4:8])).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit sub-block scales and 8 mins."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = d * sc * q - dmin * m over 8 sub-blocks of 32 (q: [n, 8, 32])."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return ((d * sc)[..., None] * q.float() - (dmin * mn)[..., None]).reshape(len(b), _QK_K)


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes in 4 chunks of 32 -> [n, 8, 32]: each chunk's low nibbles, then its high ones."""
    chunks = qs.reshape(len(qs), 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(len(qs), 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _low_high(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].reshape(len(b), 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)) & 1
    return _k_affine(b, _low_high(b[:, 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    ql, qh = b[:, :128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    d = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
    return (d[..., None] * q).reshape(n, _QK_K)


_DEQUANTIZE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, qtype: GgufType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, row_bytes] uint8 -> [N, K] in ``dtype`` (computed in float32)."""
    n, row_bytes = raw.shape
    blocks = raw.reshape(-1, qtype.block_bytes)
    k = row_bytes // qtype.block_bytes * qtype.block_elems
    return _DEQUANTIZE[qtype.name](blocks).reshape(n, k).to(dtype)
