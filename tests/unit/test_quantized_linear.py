"""Weight-only quantization (layers/quantization): each format's round trip stays within its error bound,
and every way a layer multiplies (torch's CPU kernels, the dequantize path CUDA takes) equals
x @ dequantize(W).T; sharded layers quantize their own shard; the names accepted agree everywhere."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from paged_runtime.layers.linear import (LinearBase, MergedColumnParallelLinear, RowParallelLinear,
                                         TensorParallel, UnquantizedLinearMethod)
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.quantization import NAMES, linear_method, resident_bytes
from paged_runtime.layers.quantization.int4 import GROUP_SIZE, dequantize_int4, quantize_int4, unpack_int4
from paged_runtime.layers.quantization.int8 import dequantize_int8, quantize_int8

CPU, BF16, F32 = torch.device("cpu"), torch.bfloat16, torch.float32


@dataclass(frozen=True)
class LocalRank(TensorParallel):
    """A rank whose all-reduce is left to the test (as in test_layers.py)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def randn(*shape: int, seed: int = 0, std: float = 0.05) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def dequantized(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight the format stores for ``weight`` (already in the model dtype)."""
    if name == "int8":
        return dequantize_int8(*quantize_int8(weight, weight.dtype))
    return dequantize_int4(*quantize_int4(weight, weight.dtype), weight.shape[1])


def loaded_layer(name: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 cpu_kernels: bool = True) -> LinearBase:
    method = linear_method(name, TorchOps())
    method.cpu_kernels = cpu_kernels
    layer = LinearBase(weight.shape[1], weight.shape[0], bias is not None, method, dtype, CPU)
    layer.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.weight_loader(layer.bias, bias)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_int8_round_trip_is_within_half_a_step_per_output_channel(dtype):
    weight = randn(48, 200, seed=1).to(dtype)
    weight[3] = 0  # an all-zero row keeps a finite scale
    qweight, scale = quantize_int8(weight, dtype)
    assert qweight.dtype == torch.int8 and qweight.abs().max() <= 127 and scale.dtype == dtype
    error = (dequantize_int8(qweight, scale) - weight.float()).abs()
    assert (error <= scale.float()[:, None] / 2 * (1 + 1e-3) + 1e-12).all()
    assert torch.equal(dequantize_int8(qweight, scale)[3], torch.zeros(200))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_int4_round_trip_is_within_half_a_step_per_group_and_pads_to_whole_groups(dtype):
    weight = randn(32, 200, seed=2).to(dtype)  # 200 columns: two groups of 128 after padding
    weight[5] = 0.25  # a constant row
    qweight, scales_and_zeros = quantize_int4(weight, dtype)
    assert qweight.shape == (32, 128) and scales_and_zeros.shape == (2, 32, 2)
    codes = unpack_int4(qweight)
    assert codes.shape == (32, 256) and codes.max() <= 15
    scale = scales_and_zeros[..., 0].float().T.repeat_interleave(GROUP_SIZE, 1)[:, :200]
    zero = scales_and_zeros[..., 1].float().T.repeat_interleave(GROUP_SIZE, 1)[:, :200]
    error = (dequantize_int4(qweight, scales_and_zeros, 200) - weight.float()).abs()
    # Scale and zero are rounded to the model dtype before quantizing: a bfloat16 group's range shifts by
    # at most their rounding (2^-9 relative each, the zero's weighing 8 steps).
    slack = 0 if dtype == F32 else 2 ** -8 * (zero.abs() + 8 * scale)
    assert (error <= scale / 2 * (1 + 1e-3) + slack + 1e-7).all()
    tol = 1e-6 if dtype == F32 else 2 ** -7  # the second group holds zero padding: 0.25 is its top code
    assert torch.allclose(dequantize_int4(qweight, scales_and_zeros, 200)[5], torch.full((200,), 0.25), atol=tol)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernel", "dequantize"])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(96, 576), (40, 80), (64, 256)])
def test_apply_equals_x_times_the_dequantized_weight(name, dtype, cpu_kernels, shape):
    weight, bias = randn(*shape, seed=3).to(dtype), randn(shape[0], seed=4).to(dtype)
    layer = loaded_layer(name, weight, bias, dtype, cpu_kernels)
    x = randn(5, shape[1], seed=5, std=1.0).to(dtype)
    out = layer(x)
    want = x.float() @ dequantized(name, weight).T + bias.float()
    assert out.dtype == dtype and out.shape == (5, shape[0])
    # float32 differs only in summation order; bfloat16 rounds the output (and the dequantize path's weights)
    tol = 1e-5 if dtype == F32 else 2 ** -7
    assert (out.float() - want).abs().max() <= tol * want.abs().max()
    kernel = getattr(layer, f"{name}_kernel")
    expected_kernel = cpu_kernels and dtype == BF16 and (shape[1] % 16 == 0 if name == "int8" else shape[0] % 16 == 0)
    assert kernel == expected_kernel


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_the_int8_kernel_takes_unaligned_and_strided_activations(name):
    weight = randn(32, 128, seed=6).to(BF16)
    layer = loaded_layer(name, weight, None, BF16)
    wide = randn(4, 136, seed=7, std=1.0).to(BF16)
    x = wide[1:, 8:]  # neither contiguous nor 64-byte aligned
    want = x.float() @ dequantized(name, weight).T
    assert (layer(x).float() - want).abs().max() <= 2 ** -7 * want.abs().max()
    assert layer(x[:0]).shape == (0, 32)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantizing_frees_the_full_precision_weight(name):
    weight = randn(256, 512, seed=8).to(BF16)
    plain = LinearBase(512, 256, False, UnquantizedLinearMethod(TorchOps()), BF16, CPU)
    layer = loaded_layer(name, weight, None, BF16)
    assert "weight" not in dict(layer.named_parameters())
    ratio = resident_bytes(layer) / resident_bytes(plain)
    assert ratio <= {"int8": 0.51, "int4": 0.29}[name], ratio


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_sharded_layers_quantize_their_shard(name):
    """Column shards hold the unsharded layer's quantized rows; row shards quantize their own columns (their
    partial products sum to x @ W.T within the format's error)."""
    gate, up, x = randn(32, 256, seed=9).to(BF16), randn(32, 256, seed=10).to(BF16), randn(3, 256, seed=11, std=1.0)
    x = x.to(BF16)
    whole = torch.cat([dequantized(name, gate), dequantized(name, up)])
    parts = []
    for rank in range(2):
        layer = MergedColumnParallelLinear(256, [32, 32], False, linear_method(name, TorchOps()), BF16, CPU,
                                           LocalRank(rank, 2))
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        layer.process_weights_after_loading()
        parts.append(layer(x).float().split(16, dim=-1))
    out = torch.cat([p[0] for p in parts] + [p[1] for p in parts], dim=-1)
    want = x.float() @ whole.T
    assert (out - want).abs().max() <= 2 ** -7 * want.abs().max()

    down = randn(32, 192, seed=12).to(BF16)
    total = torch.zeros(3, 32)
    for rank in range(2):  # 96 columns each: int4 pads each shard to one group of 128
        layer = RowParallelLinear(192, 32, False, linear_method(name, TorchOps()), BF16, CPU, LocalRank(rank, 2))
        layer.weight_loader(layer.weight, down)
        layer.process_weights_after_loading()
        total += layer(x[:, rank * 96:(rank + 1) * 96]).float()  # the all-reduce, by hand
    exact = x.float()[:, :192] @ down.float().T
    assert (total - exact).abs().max() <= {"int8": 0.02, "int4": 0.2}[name] * exact.abs().max()


def test_the_quantization_names_agree_everywhere():
    from pydantic import ValidationError

    from paged_runtime.config import QUANTIZATIONS
    from paged_runtime.entrypoints.cli import build_parser
    from rayserve_adapter.args import AppArgs
    assert NAMES == QUANTIZATIONS  # the methods serve exactly the setting's choices, which every front end offers
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert next(a for a in serve._actions if a.dest == "quantization").choices == QUANTIZATIONS
    with pytest.raises(ValidationError, match="quantization must be one of none, int8, int4"):
        AppArgs(quantization="fp4")
    assert isinstance(linear_method(None, TorchOps()), UnquantizedLinearMethod)
    assert isinstance(linear_method("none", TorchOps()), UnquantizedLinearMethod)
    with pytest.raises(ValueError, match="none, int8, int4"):
        linear_method("fp4", TorchOps())
