"""The fused Triton layer ops (``TritonOps``) against ``TorchOps``, the oracle, op by op and in the model.

Without a GPU they run in Triton's interpreter (see conftest): float32 and float16 there, bfloat16 too
on a GPU. float32 must agree to float rounding (only the norm's sum order differs); half precisions to
one rounding step of the model dtype.
"""
from __future__ import annotations

import pytest
import torch

from .conftest import DEVICE, INTERPRETED
from paged_runtime.layers.ops import TorchOps, TritonOps
from paged_runtime.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def rand(*shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32).to(
        device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 96), (3, 576)])
def test_rms_norm_with_and_without_the_residual_add(dtype, with_residual, rows, hidden):
    x, weight = rand(rows, hidden, dtype=dtype), rand(hidden, dtype=dtype)
    residual = rand(rows, hidden + 1, dtype=dtype)[:, :hidden] * 3 if with_residual else None  # strided rows
    want, want_residual = TorchOps.rms_norm(x, weight, 1e-5, residual)
    got, got_residual = TritonOps.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)  # one rounded add either way


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (2, 1, 80)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(dtype, heads, kv_heads, head_dim):
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, TorchOps(), DEVICE)
    positions = torch.tensor([0, 7, 300, 3, 511, 64, 1], device=DEVICE)
    sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    qkv = rand(len(positions), sum(sizes), dtype=dtype)
    want = TorchOps.rope(qkv.clone(), sizes, head_dim, TorchOps.rope_inputs(rotary.cos, rotary.sin, positions, dtype))
    got = TritonOps.rope(qkv.clone(), sizes, head_dim, TritonOps.rope_inputs(rotary.cos, rotary.sin, positions, dtype))
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, **TOLERANCE[dtype], msg=name)
    torch.testing.assert_close(got[2], want[2], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 160), (4, 1536), (3, 2500)])  # 2500: not a power of two, 3 blocks
def test_silu_mul(dtype, rows, width):
    gate_up = rand(rows, 2 * width, dtype=dtype) * 4
    torch.testing.assert_close(TritonOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up), **TOLERANCE[dtype])


def test_the_triton_backend_runs_the_fused_ops(tiny_llama_dir):
    from conftest import make_llm
    llm = make_llm(tiny_llama_dir, attention_backend="triton", max_model_len=128, kv_cache_memory=2**20)
    assert llm.engine.core.ops.name == "triton"
    eager = make_llm(tiny_llama_dir, attention_backend="triton", enforce_eager=True, max_model_len=128,
                     kv_cache_memory=2**20)
    assert eager.engine.core.ops.name == "torch"  # enforce_eager: plain PyTorch arithmetic
