"""Triton store and paged-attention kernels against the torch backend (the oracle).

Every run starts from a cache and an output poisoned with NaN, so a slot the store
kernel misses, an element the attention kernel leaves unwritten, or a read outside a
sequence's context shows up as NaN. Error is measured as max |out - ref| / max |ref|
over the whole output: <= 1e-3 in fp32, <= 1e-2 in fp16 (the reference runs in fp32 on
the same fp16 inputs). Sizes are small: without a GPU this runs in Triton's interpreter.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from paged_runtime.attention import torch_backend
from paged_runtime.attention.triton_backend import TritonAttentionMetadata, build_metadata
from paged_runtime.batch import BatchItem, build_batch
from paged_runtime.kernels import attention
from paged_runtime.kernels.store_kv import store_kv

from .conftest import DEVICE, INTERPRETED

pytestmark = [pytest.mark.kernels]

TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D], a strided view like the model's
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    cache: torch.Tensor  # poisoned, with the cached context (positions before each query) written
    meta: TritonAttentionMetadata
    oracle_meta: torch_backend.AttentionMetadata


def ragged_lengths(seed: int, num_seqs: int = 6, max_context: int = 120) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens), shuffled: every batch holds decodes, whole prompts, chunks
    after a cached prefix (prefix hits, earlier chunks) and 4-token verification rows."""
    rng = random.Random(seed)
    pairs = []
    for i in range(num_seqs):
        context = rng.randint(3, max_context)
        query = (1, context, rng.randint(2, context - 1), 4)[i % 4]
        pairs.append((query, context))
    pairs.append((1, 1))  # a one-token prompt
    rng.shuffle(pairs)
    return [q for q, _ in pairs], [c for _, c in pairs]


def make_batch(seed: int, query_lens: list[int], context_lens: list[int], block_size: int, num_heads: int,
               num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> Batch:
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered, out-of-order tables
    tables = [order[sum(blocks_per_seq[:i]):sum(blocks_per_seq[:i + 1])] for i in range(len(context_lens))]
    table_rows = np.zeros((len(tables), max(map(len, tables))), np.int32)
    for row, table in zip(table_rows, tables):
        row[:len(table)] = table
    items = [BatchItem(c - q, [0] * q, 0, i) for i, (q, c) in enumerate(zip(query_lens, context_lens))]
    meta = build_metadata(build_batch(items, table_rows, block_size), DEVICE)

    num_tokens = sum(query_lens)
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cache = torch.full((num_blocks * block_size, 2, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    chunks, first = [], 0
    for item, table, q_len, ctx in zip(items, tables, query_lens, context_lens):
        slots = _slots(table, torch.arange(ctx), block_size)
        cached = slots[:item.start]
        cache[cached] = torch.randn(len(cached), 2, num_kv_heads, head_dim, generator=g).to(dtype)
        chunks.append(torch_backend.PrefillChunk(first, q_len, slots.to(DEVICE),
                                                 torch_backend.causal_mask(q_len, ctx, DEVICE)))
        first += q_len
    view = lambda x, heads: x.view(num_tokens, heads, head_dim).to(DEVICE)
    oracle_meta = torch_backend.AttentionMetadata(meta.slot_mapping, [], chunks)
    return Batch(view(q, num_heads), view(k, num_kv_heads), view(v, num_kv_heads), cache.to(DEVICE), meta,
                 oracle_meta)


def _slots(block_ids: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return torch.tensor(block_ids)[positions // block_size] * block_size + positions % block_size


def run_oracle(b: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend in fp32 on the same inputs: (output, cache after storing the step's K/V)."""
    cache = b.cache.float()
    out = torch_backend.paged_attention(b.q.float(), b.k.float(), b.v.float(), cache, b.oracle_meta, scale)
    return out, cache


def run_triton(b: Batch, scale: float, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = b.cache.clone()
    store_kv(b.k, b.v, cache, b.meta.slot_mapping)
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype, device=DEVICE)
    attention.paged_attention(b.q, cache, b.meta.query_start_loc, b.meta.seq_lens, b.meta.block_tables,
                              b.meta.block_size, b.meta.max_query_len, scale, num_splits, out=out)
    return out, cache


def assert_matches_oracle(b: Batch, num_splits: int) -> None:
    scale = b.q.shape[-1] ** -0.5
    ref, ref_cache = run_oracle(b, scale)
    out, cache = run_triton(b, scale, num_splits)
    torch.testing.assert_close(cache, ref_cache.to(cache.dtype), rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(out).all(), "output elements left unwritten (NaN) or computed from unwritten slots"
    error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert error <= TOLERANCE[b.q.dtype], f"max relative error {error:.2e}"


# (dtype, block size, head dim, query heads, KV heads): every block size, head dim and GQA ratio 1/3/4/8.
CASES = [
    (torch.float32, 16, 64, 2, 2),
    (torch.float16, 32, 128, 6, 2),
    (torch.float32, 64, 128, 8, 2),
    (torch.float16, 16, 64, 8, 1),
    (torch.float32, 32, 64, 3, 1),
    (torch.float16, 64, 64, 4, 1),
]
if not INTERPRETED:  # the interpreter computes bfloat16 wrongly; a GPU does not
    CASES += [(torch.bfloat16, 16, 128, 32, 8), (torch.bfloat16, 32, 64, 12, 4)]


def case_id(case) -> str:
    dtype, block_size, head_dim, heads, kv_heads = case
    return f"{str(dtype).removeprefix('torch.')}-bs{block_size}-d{head_dim}-gqa{heads // kv_heads}"


@pytest.mark.parametrize("num_splits", [1, 5], ids=["single-pass", "split-kv-5"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mixed_ragged_batch_matches_torch_backend(case, num_splits):
    """Decodes, whole prompts, prefix-hit chunks and verification rows in one launch; split-KV forced
    with more segments than short contexts have key tiles, so empty segments occur too."""
    dtype, block_size, head_dim, heads, kv_heads = case
    seed = CASES.index(case)
    query_lens, context_lens = ragged_lengths(seed)
    b = make_batch(seed, query_lens, context_lens, block_size, heads, kv_heads, head_dim, dtype)
    assert_matches_oracle(b, num_splits)


@pytest.mark.parametrize("query_lens, context_lens", [
    ([16, 1, 32, 3], [16, 40, 32, 3]),  # 16-query tiles: whole-tile lengths leave gaps inside the grid
    ([5], [70]),  # a single sequence
], ids=["tile-gaps", "one-sequence"])
def test_tile_numbering_edges(query_lens, context_lens):
    b = make_batch(3, query_lens, context_lens, 16, 2, 2, 64, torch.float32)
    assert attention._block_shape(1, b.meta.max_query_len) == (16, 16)
    assert_matches_oracle(b, 1)


def test_long_decodes_split_by_the_rule_and_match():
    """A decode-only batch of a few long contexts: the rule picks split-KV, and it matches."""
    query_lens, context_lens = [1, 1, 1], [1100, 600, 40]
    b = make_batch(7, query_lens, context_lens, 16, 4, 2, 64, torch.float32)
    splits = attention.num_kv_splits(len(query_lens), 2, b.meta.max_query_len, b.meta.max_seq_len, num_sms=132)
    assert splits == 8  # min(64 segments, 264 programs / (3 seqs x 2 KV heads), 1100 // 128 keys)
    assert_matches_oracle(b, splits)


# (sequences, KV heads, max query len, longest context, SMs) -> segments.
SPLIT_TABLE = [
    ((1, 8, 1, 4096, 132), 32),  # 264 programs wanted: 33 segments, capped by 4096 // 128 keys
    ((1, 8, 1, 32768, 132), 33),  # 33 x 8 = 264 programs
    ((1, 1, 1, 32768, 132), 64),  # capped at SPLIT_MAX_SEGMENTS
    ((8, 8, 1, 4096, 132), 5),  # ceil(264 / 64)
    ((32, 8, 1, 4096, 132), 2),  # 256 programs: one short of two per SM
    ((33, 8, 1, 4096, 132), 1),  # 264 programs: the grid is full
    ((64, 8, 1, 32768, 132), 1),
    ((1, 8, 1, 1500, 132), 11),  # segments >= 128 keys
    ((1, 8, 1, 200, 132), 1),  # too short to split
    ((1, 8, 2, 32768, 132), 1),  # not decode-only
    ((4, 8, 1, 32768, 78), 5),  # another SM count: ceil(156 / 32)
]


@pytest.mark.parametrize("args, expected", SPLIT_TABLE, ids=lambda v: str(v))
def test_split_rule(args, expected):
    assert attention.num_kv_splits(*args) == expected


def test_split_rule_bounds_and_graph_sizes():
    """Never above SPLIT_MAX_SEGMENTS nor below 1, never more segments for a bigger batch, and the
    count a CUDA graph is captured with (triton_ops' rule, max_model_len) is the kernel's own rule
    at this device's SM count."""
    from paged_runtime.kernels import triton_ops
    from paged_runtime.worker.cuda_graphs import capture_sizes
    for sms in (16, 78, 132, 144):
        for context in (1, 127, 128, 1000, 4096, 131072):
            for kv_heads in (1, 2, 8):
                counts = [attention.num_kv_splits(s, kv_heads, 1, context, sms) for s in range(1, 300)]
                assert all(1 <= c <= attention.SPLIT_MAX_SEGMENTS for c in counts)
                assert counts == sorted(counts, reverse=True)
    if INTERPRETED:
        assert attention.sm_count() == attention.SM_COUNT_DEFAULT
    for size in capture_sizes(256):
        assert triton_ops.num_kv_splits(size, 8, 1, 32768) == \
            attention.num_kv_splits(size, 8, 1, 32768, attention.sm_count())


def test_tile_shapes():
    """Decode-only launches get wide key tiles by head dim; prompt rows keep 32-key tiles."""
    assert attention.tile_shape(64, 1)[0] == 128
    assert attention.tile_shape(80, 1)[0] == attention.tile_shape(128, 1)[0] == 64  # 80 pads to 128
    assert attention.tile_shape(256, 1)[0] == 32
    assert attention.tile_shape(64, 1, element_size=4)[0] == 64  # fp32: a K + V stage stays <= 32 KiB
    assert attention.tile_shape(128, 1, element_size=4)[0] == 32
    assert attention.tile_shape(128, 2) == (attention.PREFILL_TILE_N, attention.PREFILL_NUM_WARPS,
                                            attention.PREFILL_NUM_STAGES)


# (context lengths, splits, head dim, query heads, KV heads, block size): decode-only batches of 1 and 3
# sequences with many segments (fp16 for even counts, fp32 for odd). Decode tiles are 128 keys at D 64 and 64 at
# D 80 / 128 in fp16, half that in fp32, so most segments of a few-hundred-key context are empty, and 700 keys
# in fp32 D 64 (11 tiles of 64 -> 4, 4, 3 over 3 segments) or 600 keys in fp16 D 128 (10 tiles of 64 -> 3, 3,
# 3, 1 over 4 segments) leave uneven last segments.
MANY_SEGMENTS = [
    ([300], 32, 64, 8, 1, 16),
    ([450], 64, 128, 4, 1, 32),
    ([300, 77, 513], 32, 80, 4, 2, 16),
    ([200, 1, 390], 64, 64, 2, 2, 32),
    ([700, 129, 256], 3, 64, 8, 2, 16),
    ([600, 65], 4, 128, 2, 1, 32),
]


@pytest.mark.parametrize("context_lens, splits, head_dim, heads, kv_heads, block_size", MANY_SEGMENTS,
                         ids=lambda v: str(v).replace(" ", ""))
def test_decode_batches_with_many_segments(context_lens, splits, head_dim, heads, kv_heads, block_size):
    dtype = torch.float32 if splits % 2 else torch.float16
    b = make_batch(len(context_lens) + splits, [1] * len(context_lens), context_lens, block_size, heads, kv_heads,
                   head_dim, dtype)
    assert_matches_oracle(b, splits)


def test_store_skips_padding_slots():
    """Strided k/v (views of a fused projection) land in their slots exactly; slot -1 writes nothing."""
    g = torch.Generator().manual_seed(0)
    num_tokens, kv_heads, head_dim = 7, 3, 64
    fused = torch.randn(num_tokens, 5 * kv_heads * head_dim, generator=g).to(DEVICE)
    k = fused[:, :kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = fused[:, 3 * kv_heads * head_dim:4 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    slot_mapping = torch.tensor([5, -1, 0, 17, -1, 30, 2], device=DEVICE)
    cache = torch.full((32, 2, kv_heads, head_dim), float("nan"), device=DEVICE)
    store_kv(k, v, cache, slot_mapping)
    expected = torch.full_like(cache, float("nan"))
    real = slot_mapping >= 0
    expected[slot_mapping[real]] = torch.stack((k[real], v[real]), dim=1)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    assert cache.isnan().sum() == (32 - 5) * 2 * kv_heads * head_dim  # the 2 padding tokens wrote nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 at the benchmark's shape: GPU only")
@pytest.mark.parametrize("batch, context", [(1, 4096), (3, 2000), (8, 4096)])
def test_bf16_decode_at_the_benchmark_shape(batch, context):
    """Llama-3-8B attention (32 / 8 heads, D 128, blocks of 16) split by the device's own rule."""
    b = make_batch(batch, [1] * batch, [context] * batch, 16, 32, 8, 128, torch.bfloat16)
    splits = attention.num_kv_splits(batch, 8, 1, context)
    assert splits > 1
    assert_matches_oracle(b, splits)
