"""The model's linear: one bfloat16 row on the CPU takes torch.mv (faster there), with GEMM's accuracy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_runtime.layers.ops import TorchOps

linear = TorchOps.linear


def test_single_bfloat16_row_matches_the_float32_product_within_bfloat16_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    exact = F.linear(x.float(), w.float(), b.float())
    out = linear(x, w, b)
    assert out.shape == (1, 96) and out.dtype == torch.bfloat16
    # One bf16 rounding of the result (plus the bias add): relative error well under 1%.
    assert torch.allclose(out.float(), exact, rtol=1e-2, atol=2e-2)
    assert (out.float() - exact).abs().max() < (F.linear(x, w, b).float() - exact).abs().max() + 0.1


def test_other_shapes_and_dtypes_are_plain_linear():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))
    x1 = torch.randn(1, 8)
    assert torch.equal(linear(x1, w), F.linear(x1, w))  # float32: no mv
