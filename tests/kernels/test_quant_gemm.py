"""The weight-only quantized GEMMs (``kernels/quant_gemm.py``: ``triton_w8a16_linear``, ``triton_w4a16_linear``,
``triton_gguf_linear``) against their layouts' reference, the whole weight dequantized (``dequantize_int8`` /
``dequantize_int4`` / ``gguf_blocks.dequantize``) then ``F.linear``. Row counts of one decode row, a partial tile
and several tiles; N and K that are not whole tiles, and int4's K that is not whole groups (SmolLM2's 576, padded
to 640). float32 agrees to the order of float32 sums (the dots run "ieee"); float16 (and bfloat16, on a GPU)
within a rounding step of the largest output (the reference rounds each dequantized weight, the kernels too, and
both round the output once). Without a GPU the kernels run in Triton's interpreter (see conftest)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.helpers.gguf_blocks import random_blocks

from paged_runtime.kernels import triton_ops
from paged_runtime.layers.quantization.gguf_blocks import SERVED, dequantize
from paged_runtime.layers.quantization.int4 import dequantize_int4, quantize_int4
from paged_runtime.layers.quantization.int8 import dequantize_int8, quantize_int8

from .conftest import DEVICE, INTERPRETED

pytestmark = [pytest.mark.kernels]

DTYPES = (torch.float32, torch.float16) + (() if INTERPRETED else (torch.bfloat16,))  # the interpreter has no bf16
STEP = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    bound = STEP[dtype] * max(1., ref.float().abs().max().item()) * 2
    assert (out.float() - ref.float()).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 80), (5, 64, 64), (33, 130, 200)])
def test_w8a16_matches_dequantize_then_linear(dtype, m, n, k):
    qweight, scale = quantize_int8(randn(n, k, seed=n) * 0.1, dtype)
    x = randn(m, k, seed=m).to(dtype)
    ref = F.linear(x, dequantize_int8(qweight, scale, dtype))
    out = triton_ops.w8a16_linear(x.to(DEVICE), qweight.to(DEVICE), scale.to(DEVICE))
    assert_close(out.cpu(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (5, 64, 576), (33, 130, 256)])
def test_w4a16_matches_dequantize_then_linear(dtype, m, n, k):
    qweight, scales_and_zeros = quantize_int4(randn(n, k, seed=n) * 0.1, dtype)
    x = randn(m, k, seed=m).to(dtype)
    ref = F.linear(x, dequantize_int4(qweight, scales_and_zeros, k, dtype))
    out = triton_ops.w4a16_linear(x.to(DEVICE), qweight.to(DEVICE), scales_and_zeros.to(DEVICE))
    assert_close(out.cpu(), ref, dtype)


def test_w4a16_reads_each_nibble_as_its_column():
    """One weight row with a single nonzero code per column position: the kernel must take column 2j from the low
    nibble and 2j + 1 from the high one, exactly (integers and powers of two: no rounding anywhere)."""
    k, n = 128, 16
    codes = torch.full((n, k), 8, dtype=torch.uint8)  # 8 -> zero
    for row in range(n):
        codes[row, row] = 9 + row % 7  # row r reads column r, weight (code - 8) * 1
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales_and_zeros = torch.stack([torch.ones(1, n), torch.zeros(1, n)], dim=-1)
    x = torch.arange(1, k + 1, dtype=torch.float32)[None]
    out = triton_ops.w4a16_linear(x.to(DEVICE), qweight.to(DEVICE), scales_and_zeros.to(DEVICE)).cpu()
    expected = torch.tensor([(r + 1) * (1 + r % 7) for r in range(n)], dtype=torch.float32)[None]
    assert torch.equal(out, expected)


GGUF_TYPES = sorted(SERVED)


def gguf_weight(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(n, k, name, np.random.default_rng(seed)))


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_tiles_hold_the_blocks_dequantized_values_exactly(name):
    """x = the identity: each output is one weight times 1 plus zeros, so the product shows the kernel's
    weights themselves, which must be ``gguf_blocks.dequantize``'s bit for bit (every quant, high bit, scale
    and min read from its place in the block, the same float32 operations in the same order)."""
    qtype, k = SERVED[name], 2 * SERVED[name].block_elems
    raw = gguf_weight(name, 70, k, seed=len(name))
    out = triton_ops.gguf_linear(torch.eye(k).to(DEVICE), raw.to(DEVICE), qtype.id).cpu()
    assert torch.equal(out, dequantize(raw, qtype).T)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_matches_dequantize_then_linear(name, dtype):
    """SmolLM2's width (576: 18 blocks of 32, not whole K tiles) for the 32-weight blocks, 512 for the K-quants;
    rows of a decode step and of a partial tile."""
    qtype = SERVED[name]
    k = 576 if qtype.block_elems == 32 else 512
    raw = gguf_weight(name, 96, k, seed=3)
    x = randn(5, k, seed=4).to(dtype)
    ref = F.linear(x, dequantize(raw, qtype, dtype))
    assert_close(triton_ops.gguf_linear(x.to(DEVICE), raw.to(DEVICE), qtype.id).cpu(), ref, dtype)


def test_gguf_refuses_inputs_the_rows_do_not_hold():
    raw = gguf_weight("Q4_K", 4, 256, seed=0).to(DEVICE)
    with pytest.raises(ValueError, match="multiple of 256 weights, not 128"):
        triton_ops.gguf_linear(torch.zeros(1, 128, device=DEVICE), raw, SERVED["Q4_K"].id)
    with pytest.raises(ValueError, match="Q4_K rows of 512 inputs take 288 bytes, not 144"):
        triton_ops.gguf_linear(torch.zeros(1, 512, device=DEVICE), raw, SERVED["Q4_K"].id)


def _gguf_layer(name: str, raw: torch.Tensor):
    from torch import nn

    from paged_runtime.layers.linear import SINGLE
    from paged_runtime.layers.quantization.gguf import GGUFLinearMethod
    method, layer = GGUFLinearMethod(kernels=None), nn.Module()
    layer.tp, layer.input_size = SINGLE, raw.shape[1] // SERVED[name].block_bytes * SERVED[name].block_elems
    method.create_weights(layer, torch.float32, torch.device("cpu"))
    layer.qweight.weight_loader(layer.qweight, raw)
    layer.qweight_type.weight_loader(layer.qweight_type, torch.full((len(raw),), SERVED[name].id))
    method.process_weights_after_loading(layer)
    return method, layer


@pytest.mark.parametrize("name", ["int8", "int4", "Q4_K"])
def test_the_linear_methods_multiply_with_the_triton_gemms_where_they_apply(name, monkeypatch):
    """Where ``triton_applies`` (CUDA with Triton; here forced, the kernels interpreted) int8, int4 and GGUF
    layers multiply through their ``paged_runtime::triton_*_linear`` op, not a dequantized copy."""
    from paged_runtime.layers.linear import LinearBase
    from paged_runtime.layers.ops import TorchOps
    from paged_runtime.layers.quantization import gguf, int4, int8, linear_method
    op = {"int8": "w8a16_linear", "int4": "w4a16_linear", "Q4_K": "gguf_linear"}[name]
    calls = []
    real = getattr(triton_ops, op)
    monkeypatch.setattr(triton_ops, op, lambda *args: calls.append(op) or real(*args))
    for module in (gguf, int4, int8):
        monkeypatch.setattr(module, "triton_applies", lambda x: True)
    x = randn(3, 256, seed=1)
    if name == "Q4_K":
        raw = gguf_weight(name, 32, 256, seed=2)
        method, layer = _gguf_layer(name, raw)
        out, ref = method.apply(layer, x, None), F.linear(x, dequantize(raw, SERVED[name]))
    else:
        method = linear_method(name, TorchOps())
        method.cpu_kernels = False
        layer = LinearBase(256, 32, False, method, torch.float32, torch.device("cpu"))
        layer.weight_loader(layer.weight, randn(32, 256, seed=2) * 0.1)
        layer.process_weights_after_loading()
        out = layer(x)
        ref = F.linear(x, dequantize_int8(layer.qweight, layer.scale) if name == "int8" else
                       dequantize_int4(layer.qweight, layer.scales_and_zeros, 256))
    assert calls == [op]
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["int8", "int4", "Q4_1", "Q6_K"])
def test_split_k_partial_sums_add_up_to_the_whole_product(kind, dtype):
    """Decode's regime: K asked in 3 splits of whole K tiles (576 = 9 tiles: 3 + 3 + 3; int4's 640 = 10 tiles:
    4 + 4 + 2, the last one short; Q6_K's 768 = 12 tiles: 4 + 4 + 4), each writing fp32 partial sums that one sum
    over the splits rounds to x's dtype."""
    from paged_runtime.kernels import quant_gemm
    k = 576 if kind != "Q6_K" else 768
    x = randn(2, k, seed=5).to(dtype)
    if kind == "int8":
        qweight, scale = quantize_int8(randn(70, k, seed=6) * 0.1, dtype)
        ref, run = F.linear(x, dequantize_int8(qweight, scale, dtype)), quant_gemm.w8a16_linear
        weight = (qweight.to(DEVICE), scale.to(DEVICE))
    elif kind == "int4":
        qweight, scales_and_zeros = quantize_int4(randn(70, k, seed=6) * 0.1, dtype)
        ref, run = F.linear(x, dequantize_int4(qweight, scales_and_zeros, k, dtype)), quant_gemm.w4a16_linear
        weight = (qweight.to(DEVICE), scales_and_zeros.to(DEVICE))
    else:
        raw = gguf_weight(kind, 70, k, seed=6)
        ref, run = F.linear(x, dequantize(raw, SERVED[kind], dtype)), quant_gemm.gguf_linear
        weight = (raw.to(DEVICE), SERVED[kind].id)
    whole, split = run(x.to(DEVICE), *weight, split=1).cpu(), run(x.to(DEVICE), *weight, split=3).cpu()
    assert_close(whole, ref, dtype)
    assert_close(split, ref, dtype)
    if dtype == torch.float32:  # the same products, summed in another order
        assert not torch.equal(split, whole)


def test_split_k_splits_decode_products_to_fill_the_device_and_leaves_prefill_whole():
    from paged_runtime.kernels.quant_gemm import split_k
    sms = 132  # an H100 / H200
    assert split_k(1, 4096, 4096, sms) == 5  # 64 tiles of N: 264 programs wanted, 5 splits of 12-13 K tiles
    assert split_k(1, 4096, 14336, sms) == 5
    assert split_k(64, 4096, 4096, sms) == 2  # 4 x 64 tiles
    assert split_k(2048, 4096, 4096, sms) == 1  # prefill: 8,192 tiles
    assert split_k(1, 576, 576, sms) == 2  # SmolLM2: 9 tiles of N, 9 of K; splits of at least 4 K tiles
    assert split_k(1, 64, 128, sms) == 1  # K of 2 tiles does not split
