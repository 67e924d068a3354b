"""The weight-only quantized GEMMs (``kernels/quant_gemm.py``: ``triton_w8a16_linear``, ``triton_w4a16_linear``)
against their layouts' reference, the whole weight dequantized (``dequantize_int8`` / ``dequantize_int4``) then
``F.linear``. Row counts of one decode row, a partial tile and several tiles; N and K that are not whole tiles,
and int4's K that is not whole groups (SmolLM2's 576, padded to 640). float32 agrees to the order of float32 sums
(the dots run "ieee"); float16 (and bfloat16, on a GPU) within a rounding step of the largest output (the reference rounds
each dequantized weight, the kernels too, and both round the output once). Without a GPU the kernels run in
Triton's interpreter (see conftest)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_runtime.kernels import triton_ops
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
