"""TritonOps.lora_delta (the shrink and expand kernels, ``kernels/lora.py``) against TorchOps.lora_delta (the
oracle): rows of several slots mixed with base rows (-1), layers of one to three parts of unequal widths, ranks
below R zero-padded. fp32 agrees to the order of fp32 sums; fp16 to a unit or two in the last place (both round
u and the delta where torch does). Without a GPU the kernels run in Triton's interpreter (see conftest)."""
from __future__ import annotations


import pytest
import torch

from paged_runtime.layers.ops import TorchOps, TritonOps

from .conftest import DEVICE

pytestmark = [pytest.mark.kernels]

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
IN, RANK, SLOTS = 64, 8, 4
SLICES = {1: (160,), 2: (96, 64), 3: (96, 32, 32)}


def randn(*shape: int, dtype=torch.float32, seed: int = 0, scale: float = 1.) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def slot_weights(slices: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a [S, N*R, in], b [S, out, R] as ``LoRAWeights`` holds them: slot s's parts of rank R - s (ranks past it
    zero, as ``place_part`` pads them); slot S-1 stays all zero (a free slot)."""
    n, out = len(slices), sum(slices)
    a = randn(SLOTS, n * RANK, IN, dtype=dtype, seed=seed, scale=0.2)
    b = randn(SLOTS, out, RANK, dtype=dtype, seed=seed + 1, scale=0.2)
    for s in range(SLOTS):
        rank = RANK - s if s < SLOTS - 1 else 0
        b[s, :, rank:] = 0
        for i in range(n):
            a[s, i * RANK + rank:(i + 1) * RANK] = 0
    return a, b


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("num_parts", (1, 2, 3))
@pytest.mark.parametrize("num_tokens", (1, 5, 17))
def test_lora_delta_matches_torch(dtype, num_parts, num_tokens):
    slices = SLICES[num_parts]
    a, b = slot_weights(slices, dtype, seed=num_parts)
    x = randn(num_tokens, IN, dtype=dtype, seed=10 + num_tokens)
    y = randn(num_tokens, sum(slices), dtype=dtype, seed=20 + num_tokens)
    pattern = [2, -1, 0, 1, 0, 3, -1] if num_tokens > 1 else [1]
    row_slots = torch.tensor((pattern * num_tokens)[:num_tokens], dtype=torch.int64, device=DEVICE)
    want = y.clone()
    TorchOps.lora_delta(want, x, a, b, row_slots, slices)
    got = y.clone()
    TritonOps.lora_delta(got, x, a, b, row_slots, slices)
    torch.testing.assert_close(got, want, **TOL[dtype])
    unchanged = (row_slots < 0) | (row_slots == SLOTS - 1)  # base rows, and rows of the zero slot (+0 exactly)
    assert torch.equal(got[unchanged], y[unchanged])
    assert (got[~unchanged] != y[~unchanged]).any(dim=1).all()  # every adapter row did add something


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_small_blocks_straddle_parts(dtype, monkeypatch):
    """Blocks smaller than the shapes: the shrink loops over ``in``, output blocks of 32 straddle parts of
    ragged widths (a column's part, not its block's, picks the ranks), and the last block is ragged."""
    from paged_runtime.kernels import lora
    monkeypatch.setattr(lora, "SHRINK_BLOCK_K", 16)
    monkeypatch.setattr(lora, "SHRINK_BLOCK_R", 4)
    monkeypatch.setattr(lora, "EXPAND_TILE", 32 * RANK)
    slices = (70, 50, 40)
    a, b = slot_weights(slices, dtype, seed=12)
    x, y = randn(6, IN, dtype=dtype, seed=13), randn(6, sum(slices), dtype=dtype, seed=14)
    row_slots = torch.tensor([0, -1, 2, 1, 1, 0], device=DEVICE)
    want, got = y.clone(), y.clone()
    TorchOps.lora_delta(want, x, a, b, row_slots, slices)
    TritonOps.lora_delta(got, x, a, b, row_slots, slices)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_base_rows_only_and_empty_batch():
    a, b = slot_weights(SLICES[3], torch.float32, seed=7)
    y = randn(3, 160, seed=8)
    got = y.clone()
    TritonOps.lora_delta(got, randn(3, IN, seed=9), a, b, torch.full((3,), -1, device=DEVICE), SLICES[3])
    assert torch.equal(got, y)
    TritonOps.lora_delta(y[:0], randn(0, IN), a, b, torch.empty(0, dtype=torch.int64, device=DEVICE), SLICES[3])


def test_registered_op_has_a_fake():
    """The op traces under fake tensors (torch.compile) without running the kernels: its fake writes nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    a, b = slot_weights(SLICES[2], torch.float32, seed=11)
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.empty(4, 160)
        torch.ops.paged_runtime.triton_lora_delta(y, torch.empty(4, IN), a, b, torch.zeros(4, dtype=torch.int64),
                                                  list(SLICES[2]))

