"""The encoder backend (``attention/encoder_backend.py``): each item of a step attends to all of its own rows and
to nothing else (no other item, no padding), as plain softmax attention over that item alone; it refuses a step
whose item does not start at position 0 (a chunk of a prompt)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_runtime.attention.encoder_backend import build_metadata
from paged_runtime.batch import BatchItem, build_batch

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def batch_of(lengths: list[int], starts: list[int] | None = None):
    starts = starts or [0] * len(lengths)
    items = [BatchItem(start, list(range(n)), 0, row) for row, (start, n) in enumerate(zip(starts, lengths))]
    tables = np.arange(len(lengths) * 8, dtype=np.int32).reshape(len(lengths), 8)
    return build_batch(items, tables, block_size=16)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One item's rows over its own rows only, both ways, in explicit float64 ops."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v.double())


@pytest.mark.parametrize("lengths", [[3, 1, 5], [4, 4], [1]])
def test_each_item_attends_to_itself_alone_both_ways(lengths):
    torch.manual_seed(0)
    num_tokens = sum(lengths)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM)
    k, v = (torch.randn(num_tokens, KV_HEADS, HEAD_DIM) for _ in range(2))
    meta = build_metadata(batch_of(lengths), torch.device("cpu"))
    out = meta.attend(q, k, v, None, HEAD_DIM ** -0.5)
    bounds = np.cumsum([0] + lengths)
    for first, end in zip(bounds[:-1], bounds[1:]):
        rows = slice(first, end)
        want = reference(q[rows], k[rows], v[rows], HEAD_DIM ** -0.5)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=0)
    assert (meta.mask is None) == (len(set(lengths)) == 1)  # a mask only where there is padding


def test_a_chunk_that_does_not_start_at_position_zero_is_refused():
    with pytest.raises(AssertionError, match="computed whole, from position 0"):
        build_metadata(batch_of([3, 2], starts=[0, 5]), torch.device("cpu"))
