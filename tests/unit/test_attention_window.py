"""The torch backend's sliding window and soft cap against attention written out from its definition.

The torch backend is the oracle the kernels are tested against, so it is itself checked here against a
per-query loop over the sequence's whole context: scores q.k * scale, capped c * tanh(s / c), keys
p - W + 1 .. p only, softmax, times v. Every batch holds decodes (in one group, of unequal lengths),
verifications (last token + drafts) and prompt chunks (whole prompts and chunks after a cached prefix).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_runtime.attention import torch_backend
from paged_runtime.batch import BatchItem, build_batch, layout_order

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
SCALE = DIM ** -0.5
# (start, new tokens, drafts): decodes, verifications, a whole prompt, chunks after a cached prefix
ITEMS = [(20, 1, 0), (5, 1, 0), (33, 1, 0), (17, 4, 3), (9, 3, 2), (0, 26, 0), (12, 9, 0), (30, 5, 0)]


def reference(q, keys, values, positions, window, softcap):
    """q [L, H, D] at ``positions``; keys / values [C, Hkv, D] of the whole context."""
    group = HEADS // KV_HEADS
    out = torch.empty_like(q)
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        k = keys[lo:p + 1].repeat_interleave(group, dim=1)  # [n, H, D]
        v = values[lo:p + 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k.double()) * SCALE
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v.double()).to(q.dtype)
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 6, 50])
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_torch_backend_matches_the_definition(window, softcap):
    g = torch.Generator().manual_seed(0)
    items = [BatchItem(start, [0] * n, spec, row) for row, (start, n, spec) in enumerate(ITEMS)]
    items = [items[i] for i in layout_order(items)]
    lengths = [it.start + len(it.token_ids) for it in items]
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered tables
    tables = np.zeros((len(ITEMS), max(-(-n // BLOCK) for n in lengths)), np.int32)
    context = {}
    for it, n in zip(items, lengths):
        table = [order.pop() for _ in range(-(-n // BLOCK))]
        tables[it.table_row, :len(table)] = table
        context[it.table_row] = torch.randn(n, 2, KV_HEADS, DIM, generator=g)  # the true K/V of every position
    batch = build_batch(items, tables, BLOCK)
    cache = torch.zeros(num_blocks * BLOCK, 2, KV_HEADS, DIM)
    for it in items:  # the cached prefix (earlier chunks, accepted tokens) is already in the cache
        slots = torch.from_numpy(batch.slots(slice(items.index(it), items.index(it) + 1), np.arange(it.start))[0])
        cache[slots] = context[it.table_row][:it.start]
    fresh = torch.cat([context[it.table_row][it.start:] for it in items])
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=g)

    meta = torch_backend.build_metadata(batch, torch.device("cpu"))
    out = meta.attend(q, fresh[:, 0].contiguous(), fresh[:, 1].contiguous(), cache, SCALE, window, softcap)

    for i, it in enumerate(items):
        rows = slice(int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1]))
        kv = context[it.table_row]
        expected = reference(q[rows], kv[:, 0], kv[:, 1], batch.positions[rows].tolist(), window, softcap)
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)


def test_a_window_changes_the_result():
    """So the test above can fail: a window of 3 is not full attention on these contexts."""
    keys, values = torch.randn(10, KV_HEADS, DIM), torch.randn(10, KV_HEADS, DIM)
    q = torch.randn(1, HEADS, DIM)
    assert not torch.allclose(reference(q, keys, values, [9], 3, None), reference(q, keys, values, [9], None, None))
