"""int4 weight-only (W4A16): asymmetric, one scale and zero per group of 128 input features.

Format (torch's int4 kernels' convention): code q in [0, 15] stands for ``(q - 8) * scale + zero``; a group's
range [min, max] maps onto codes 0..15 (scale = (max - min) / 15, zero = min + 8 * scale, both rounded to the
model dtype before quantizing). The input features are zero-padded to a multiple of the group size
(SmolLM2's 576 -> 640), so every group has 128 columns; the activations are padded to match.

Stored plainly as ``qweight`` uint8 [N, K_padded / 2] (column 2j in the low nibble, 2j + 1 in the high) and
``scales_and_zeros`` [K_padded / 128, N, 2] in the model dtype. With torch's CPU kernel, ``qweight`` holds
the kernel's own (machine-specific) tiling of the same codes instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_runtime.kernels import triton_ops
from paged_runtime.layers.linear import LinearBase
from paged_runtime.layers.quantization.base import WeightOnlyMethod, flat, triton_applies, with_bias

GROUP_SIZE = 128


def padded(in_features: int, group_size: int = GROUP_SIZE) -> int:
    return -(-in_features // group_size) * group_size


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype,
                  group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [N, K_padded / 2], scales_and_zeros [groups, N, 2] in ``dtype``) of a [N, K] weight."""
    n, k = weight.shape
    w = F.pad(weight.float(), (0, padded(k, group_size) - k)).view(n, -1, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(dtype).tiny).to(dtype)
    zero = (low + 8 * scale.float()).to(dtype)
    codes = ((w - zero.float()[..., None]) / scale.float()[..., None] + 8).round_().clamp_(0, 15)
    codes = codes.to(torch.uint8).view(n, -1)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return qweight, scales_and_zeros


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The codes, uint8 [N, K_padded], of a plainly packed ``qweight``."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(qweight.shape[0], -1)


def dequantize_int4(qweight: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int,
                    dtype: torch.dtype = torch.float32, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The [N, in_features] weight in ``dtype`` (the reference: float32)."""
    n = qweight.shape[0]
    codes = unpack_int4(qweight).view(n, -1, group_size).to(dtype)
    scale, zero = scales_and_zeros.to(dtype).transpose(0, 1).unbind(-1)  # [N, groups] each
    return ((codes - 8) * scale[..., None] + zero[..., None]).view(n, -1)[:, :in_features]


class Int4LinearMethod(WeightOnlyMethod):
    def quantize(self, layer: LinearBase, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.buffers(layer, *quantize_int4(weight, weight.dtype))

    def buffers(self, layer: LinearBase, qweight: torch.Tensor,
                scales_and_zeros: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer's buffers for a plainly packed ``qweight`` (pre-quantized checkpoints come in here too)."""
        # The CPU kernel's packing takes N in multiples of 16.
        layer.int4_kernel = self.kernel_applies(scales_and_zeros) and qweight.shape[0] % 16 == 0
        if layer.int4_kernel:
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight).to(torch.int32), 2)
        return {"qweight": qweight, "scales_and_zeros": scales_and_zeros}

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = flat(x)
        if layer.int4_kernel:
            k = rows.shape[1]
            rows = F.pad(rows, (0, padded(k) - k)) if k % GROUP_SIZE else rows
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, layer.qweight, GROUP_SIZE, layer.scales_and_zeros)
            out = with_bias(out, bias)
        elif triton_applies(rows):
            out = with_bias(triton_ops.w4a16_linear(rows, layer.qweight, layer.scales_and_zeros), bias)
        else:
            weight = dequantize_int4(layer.qweight, layer.scales_and_zeros, layer.input_size, x.dtype)
            out = F.linear(rows, weight, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])
