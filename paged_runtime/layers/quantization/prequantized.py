"""What the pre-quantized checkpoint formats (GPTQ, AWQ, compressed-tensors) share.

A checkpoint method registers parameters named as the checkpoint's tensors (``qweight``, ``scales``, ...), each
tagged with ``from_checkpoint(tensor, rows)``: the conversion of the checkpoint's tensor (int32 words packed
along either dimension, [K, N] or [N, K]) into one plain orientation, output features along dim 0 and input
features (or their groups) along dim 1. The layers' sharded loaders (``layers/linear.py``) then place it as
they place any weight: a shard of a fused q/k/v or gate/up matrix at its offset, a row-parallel rank's input
columns (so tensor parallelism needs each rank's input features to be whole groups).

After loading, the integers go into the int4 / int8 methods' own buffers unchanged (no re-quantization): a
4-bit format's ``w = (q - z) * s`` is int4's ``(q - 8) * scale + zero`` with ``scale = s`` and
``zero = (8 - z) * s``, computed in float32 and rounded once to the model dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from paged_runtime.layers.linear import LinearBase, empty_parameter
from paged_runtime.layers.quantization.int4 import GROUP_SIZE, Int4LinearMethod
from paged_runtime.layers.quantization.int8 import Int8LinearMethod

Convert = Callable[[torch.Tensor, int], torch.Tensor]


def checkpoint_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                         device: torch.device, convert: Convert) -> None:
    """Register ``name`` ([output, input]-oriented ``shape``) loaded through ``convert``."""
    param = empty_parameter(*shape, dtype=dtype, device=device)
    param.from_checkpoint = convert
    layer.register_parameter(name, param)


def unpack_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes of int32 ``words`` holding eight 4-bit values each along ``dim``, value i in bits 4i..4i+3
    (GPTQ's and compressed-tensors' order): [a, b] -> [8a, b] (dim 0) or [a, 8b] (dim 1)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed 4-bit tensor must be int32, got {words.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [a, 8, b]
        return codes.reshape(-1, words.shape[1]).to(torch.uint8)
    codes = (words[:, :, None] >> shifts) & 0xF  # [a, b, 8]
    return codes.reshape(words.shape[0], -1).to(torch.uint8)


def unpack_bytes(words: torch.Tensor) -> torch.Tensor:
    """int8 values of int32 ``words`` [a, b] holding four 8-bit values each along dim 1, value i in bits
    8i..8i+7 stored offset by 128 (compressed-tensors' 8-bit packing): [a, 4b]."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed 8-bit tensor must be int32, got {words.dtype}")
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=words.device)
    values = ((words[:, :, None] >> shifts) & 0xFF) - 128
    return values.reshape(words.shape[0], -1).to(torch.int8)


def transposed(convert: Callable[[torch.Tensor], torch.Tensor]) -> Convert:
    """A conversion for a [input, output]-oriented checkpoint tensor (GPTQ, AWQ)."""
    return lambda tensor, rows: convert(tensor).t().contiguous()


class CheckpointInt4Method(Int4LinearMethod):
    """4-bit codes q in [0, 15] with a scale s and zero z per group of 128 input features: w = (q - z) * s.

    While loading: ``codes`` uint8 [N, K], ``scales`` float32 [N, K / 128], ``zeros`` uint8 [N, K / 128] (None:
    symmetric, z = 8) under the checkpoint's names, set by the subclass in ``create_weights``."""
    codes = scales = zeros = ""  # the checkpoint's tensor names
    format_name = ""

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        n, k = layer.output_size, layer.input_size
        if k % GROUP_SIZE or n % 8:
            raise ValueError(f"{self.format_name}: a layer of {k} input features per rank and {n} outputs does "
                             f"not hold whole groups of {GROUP_SIZE} inputs and whole int32 words of 8 outputs; "
                             f"supported: input features a multiple of {GROUP_SIZE}, outputs of 8 (per "
                             "tensor-parallel rank)")
        layer.model_dtype = dtype
        for name, shape, param_dtype in [(self.codes, (n, k), torch.uint8),
                                         (self.scales, (n, k // GROUP_SIZE), torch.float32),
                                         (self.zeros, (n, k // GROUP_SIZE), torch.uint8)]:
            if name:
                checkpoint_parameter(layer, name, shape, param_dtype, device, self.converter(name))

    def converter(self, name: str) -> Convert:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        codes, scale = take(layer, self.codes), take(layer, self.scales)
        zeros = take(layer, self.zeros).float() if self.zeros else torch.full_like(scale, 8.0)
        scales_and_zeros = torch.stack([scale, (8 - zeros) * scale], dim=-1).to(layer.model_dtype)
        qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
        for name, tensor in self.buffers(layer, qweight, scales_and_zeros.transpose(0, 1).contiguous()).items():
            layer.register_buffer(name, tensor)


class CheckpointInt8Method(Int8LinearMethod):
    """int8 codes with one scale per output channel: w = q * s (``weight`` int8 [N, K], or ``weight_packed``
    int32 [N, K / 4] with ``packed``; ``weight_scale`` [N] or [N, 1])."""

    def __init__(self, packed: bool = False, cpu_kernels: bool = True) -> None:
        super().__init__(cpu_kernels)
        self.codes = "weight_packed" if packed else "weight"

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.model_dtype = dtype
        convert = ((lambda tensor, rows: unpack_bytes(tensor)) if self.codes == "weight_packed" else
                   (lambda tensor, rows: checked_dtype(tensor, torch.int8, "weight")))
        checkpoint_parameter(layer, self.codes, (layer.output_size, layer.input_size), torch.int8, device, convert)
        checkpoint_parameter(layer, "weight_scale", (layer.output_size,), torch.float32, device,
                             lambda tensor, rows: tensor.reshape(-1).float())

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        qweight, scale = take(layer, self.codes), take(layer, "weight_scale")
        for name, tensor in self.buffers(layer, qweight, scale.to(layer.model_dtype)).items():
            layer.register_buffer(name, tensor)


def take(layer: nn.Module, name: str) -> torch.Tensor:
    """The loaded parameter's data, the parameter itself removed from the layer."""
    tensor = getattr(layer, name).detach()
    delattr(layer, name)
    return tensor


def checked_dtype(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    return tensor
