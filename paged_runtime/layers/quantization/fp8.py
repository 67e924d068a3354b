"""FP8 W8A8 (``--quantization fp8``, and compressed-tensors FP8 checkpoints): float8_e4m3fn weights and
activations multiplied by ``torch._scaled_mm``.

Format: ``qweight`` float8_e4m3fn [N, K] and ``weight_scale`` float32 [N] (per output channel; a per-tensor
scale is stored repeated), W ~= qweight * weight_scale. Activations are quantized per token at each call
(scale = the row's absolute maximum / 448), or with one static scale (``input_scale``, from a checkpoint that
calibrated it). ``_scaled_mm`` multiplies the float8 operands and applies both scales in float32, writing the
model dtype. Where it is unavailable (a device or shape it does not take; probed once per layer), the
weights are dequantized to the activations' dtype and multiplied by ``F.linear`` (activations unquantized),
with one log line; weight-only FP8 checkpoints (no activation scheme) always take that path.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from paged_runtime.layers.linear import LinearBase
from paged_runtime.layers.quantization.base import WeightOnlyMethod, flat
from paged_runtime.layers.quantization.prequantized import checked_dtype, take, checkpoint_parameter

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_fallback_logged = False


def quantize_fp8(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [N, K], float32 scale [N]) of a [N, K] weight: one scale per row, or one for all (repeated)."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(w.shape[0])
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 [M, K], float32 scale [M, 1]) of activation rows: per token, or ``static_scale`` for every row."""
    x = x.float()
    if static_scale is None:
        scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` (the reference: float32)."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def scaled_mm(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (any float dtype) times the float8 weight, through ``torch._scaled_mm``."""
    xq, x_scale = quantize_activations(x, input_scale)
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=out_dtype)


def scaled_mm_works(qweight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``_scaled_mm`` takes this weight on its device with ``dtype`` output (one tiny product)."""
    global _fallback_logged
    try:
        scaled_mm(torch.ones(1, qweight.shape[1], dtype=dtype, device=qweight.device), qweight, weight_scale,
                  None, None, dtype)
        return True
    except (RuntimeError, NotImplementedError) as e:
        if not _fallback_logged:
            _fallback_logged = True
            logger.warning("fp8: torch._scaled_mm is unavailable here (%s); the FP8 weights are dequantized "
                           "for each product instead", str(e).splitlines()[0])
        return False


class Fp8LinearMethod(WeightOnlyMethod):
    """``--quantization fp8``: quantized at load, per output channel (``per_channel=False``: per tensor);
    ``cpu_kernels=False`` keeps ``_scaled_mm`` out on every device (the dequantize path; tests use it)."""

    def __init__(self, per_channel: bool = True, cpu_kernels: bool = True) -> None:
        super().__init__(cpu_kernels)
        self.per_channel = per_channel

    def quantize(self, layer: LinearBase, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.buffers(layer, *quantize_fp8(weight, self.per_channel), None, weight.dtype, True)

    def buffers(self, layer: LinearBase, qweight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None, dtype: torch.dtype, activations: bool) -> dict[str, torch.Tensor]:
        """The layer's buffers; ``activations``: whether products run in FP8 (else weight-only)."""
        layer.model_dtype = dtype
        layer.fp8_scaled_mm = activations and self.cpu_kernels and scaled_mm_works(qweight, weight_scale, dtype)
        buffers = {"qweight": qweight, "weight_scale": weight_scale}
        return buffers if input_scale is None else {**buffers, "input_scale": input_scale}

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = flat(x)
        if layer.fp8_scaled_mm:
            out = scaled_mm(rows, layer.qweight, layer.weight_scale, getattr(layer, "input_scale", None), bias,
                            x.dtype)
        else:
            out = F.linear(rows, dequantize_fp8(layer.qweight, layer.weight_scale, x.dtype), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8CheckpointMethod(Fp8LinearMethod):
    """A compressed-tensors FP8 checkpoint: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` per tensor or per
    channel, ``input_scale`` (static activations: the largest of a fused matrix's parts serves them all)."""

    def __init__(self, static_input: bool, activations: bool = True, cpu_kernels: bool = True) -> None:
        super().__init__(True, cpu_kernels)
        self.static_input, self.activations = static_input, activations

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.model_dtype = dtype
        n = layer.output_size
        checkpoint_parameter(layer, "weight", (n, layer.input_size), FP8, device,
                             lambda tensor, rows: checked_dtype(tensor, FP8, "weight"))
        for name in ("weight_scale", "input_scale") if self.static_input else ("weight_scale",):
            checkpoint_parameter(layer, name, (n,), torch.float32, device, _per_row)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        qweight, weight_scale = take(layer, "weight"), take(layer, "weight_scale")
        input_scale = take(layer, "input_scale").amax() if self.static_input else None
        for name, tensor in self.buffers(layer, qweight, weight_scale, input_scale, layer.model_dtype,
                                         self.activations).items():
            layer.register_buffer(name, tensor)


def _per_row(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor ([] or [1]) or per-channel ([rows] or [rows, 1]) scale as float32 [rows]."""
    tensor = tensor.float().reshape(-1)
    return tensor.expand(rows) if tensor.numel() == 1 else tensor
