"""int8 weight-only (W8A16): symmetric, one scale per output channel.

Format: ``qweight`` int8 [N, K] in [-127, 127] and ``scale`` [N] in the model dtype; W ~= qweight * scale.
The scale is rounded to the model dtype before quantizing, so the stored pair is exactly what was rounded to
(round-trip error at most scale / 2 per weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_runtime.kernels import triton_ops
from paged_runtime.layers.linear import LinearBase
from paged_runtime.layers.quantization.base import WeightOnlyMethod, flat, triton_applies, with_bias


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [N, K], scale [N] in ``dtype``) of a [N, K] weight."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(dtype).tiny).to(dtype)
    qweight = (w / scale.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return qweight, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` (the reference: float32; in a narrower dtype each product is rounded once)."""
    return qweight.to(dtype) * scale.to(dtype)[:, None]


class Int8LinearMethod(WeightOnlyMethod):
    def quantize(self, layer: LinearBase, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.buffers(layer, *quantize_int8(weight, weight.dtype))

    def buffers(self, layer: LinearBase, qweight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer's buffers (pre-quantized checkpoints come in here too)."""
        # _weight_int8pack_mm loads 16 activations (bf16) at a time with aligned loads and has no tail loop.
        layer.int8_kernel = self.kernel_applies(scale) and qweight.shape[1] % 16 == 0
        return {"qweight": qweight, "scale": scale}

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = flat(x)
        if layer.int8_kernel:
            if rows.data_ptr() % 64:  # a view into a larger tensor: the kernel needs aligned rows
                rows = rows.clone()
            out = with_bias(torch.ops.aten._weight_int8pack_mm(rows, layer.qweight, layer.scale), bias)
        elif triton_applies(rows):
            out = with_bias(triton_ops.w8a16_linear(rows, layer.qweight, layer.scale), bias)
        else:
            out = F.linear(rows, dequantize_int8(layer.qweight, layer.scale, x.dtype), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])
