"""What the weight-only methods share: a full-precision weight while loading, quantized tensors after."""
from __future__ import annotations

import torch

from paged_runtime.kernels import triton_available
from paged_runtime.layers.linear import LinearBase, LinearMethod, empty_parameter


def triton_applies(x: torch.Tensor) -> bool:
    """On CUDA the Triton GEMMs (``kernels/quant_gemm.py``) multiply from the quantized tiles (int8, int4 and the
    layouts stored as int4, GGUF blocks); elsewhere the weight is dequantized for ``F.linear``."""
    return x.is_cuda and triton_available()


class WeightOnlyMethod(LinearMethod):
    """Loads ``weight`` [output_size, input_size] in the model dtype, then ``quantize`` replaces it by buffers.

    ``cpu_kernels=False`` keeps torch's CPU kernels out (the dequantize path CUDA takes; tests use it)."""

    def __init__(self, cpu_kernels: bool = True) -> None:
        self.cpu_kernels = cpu_kernels

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = empty_parameter(layer.output_size, layer.input_size, dtype=dtype, device=device)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.detach()
        del layer.weight  # the last reference but ``weight``: freed when this returns
        for name, tensor in self.quantize(layer, weight).items():
            layer.register_buffer(name, tensor)

    def quantize(self, layer: LinearBase, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The buffers that replace ``weight`` (may set plain attributes on ``layer``, e.g. the kernel choice)."""
        raise NotImplementedError


    def kernel_applies(self, weight: torch.Tensor) -> bool:
        # torch's weight-only CPU kernels vectorise bfloat16 only; their float32 loops are scalar (measured
        # 5-60x slower than dequantize + F.linear on the development machine).
        return self.cpu_kernels and weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def flat(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [rows, K], contiguous."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out.add_(bias)
