"""Unified paged attention: one launch for a mixed batch of varlen queries.

Inputs (B sequences, T query tokens, H query heads sharing Hkv KV heads, head dim D)::

    q, out           [T, H, D]        query tokens, sequence after sequence
    kv_cache         [num_slots, 2, Hkv, D]   a slot's key at [slot, 0], value at [slot, 1]
    query_start_loc  [B + 1] int32    sequence i's queries are rows query_start_loc[i] ..[i + 1]
    seq_lens         [B] int32        sequence i's context length, its new tokens included
    block_tables     [B, max_blocks] int32   key p of sequence i is in slot
                                      block_tables[i, p // block_size] * block_size + p % block_size

Query j of sequence i (q_len new tokens) sits at position ``seq_lens[i] - q_len + j`` and
attends to keys 0 .. that position: causal within the new tokens, everything cached
before them (earlier chunks, prefix-cache hits). Decodes, prompt chunks and speculative
verification rows are all this one case. Query head h reads KV head h // (H / Hkv).

Sliding window W (``window > 0``): the query at position p sees keys p - W + 1 .. p only; a
program starts at the key tile holding its first query's window start, so tiles (and cache
blocks) wholly before the window are never loaded: O(W) work per query, not O(context).
Soft cap c (``softcap > 0``): each scaled score s becomes c * tanh(s / c) before the softmax.

Programs: ``grid = (T // BLOCK_Q + B, Hkv, num_segments)``. A program takes a tile of
up to BLOCK_Q consecutive queries of one sequence times the GROUP = H / Hkv query heads
that share KV head ``program_id(1)``: BLOCK_M >= BLOCK_Q * GROUP rows, so every KV tile
it loads serves the whole group. Sequence i's tiles are numbered from
``query_start_loc[i] // BLOCK_Q + i``::

    BLOCK_Q = 4, query lengths 4, 1, 3        (query_start_loc = 0, 4, 5, 8)
    tile id   0    1    2    3    4               (grid: 8 // 4 + 3 = 5 tiles)
              s0   --   s1   s2   --              (-- : a gap, the program exits)

The numbering never overlaps, and its end ``T // BLOCK_Q + B`` depends on shapes only,
so the grid is sized without reading device tensors (no host sync, fixed for a fixed
batch shape). A program finds its sequence by binary search over ``query_start_loc``.

An 8-bit cache (``QUANT``: 1 fp8 with per-tensor (k_scale, v_scale), 3 the same as e4m3 bits where Triton
has no float8_e4m3fn (Ampere), 2 int8 with a
``[num_slots, 2, Hkv]`` float32 scale per key and value row; ``kernels.kv_quant``) is read back as
value * scale in fp32 (int8: the scale rounded to q's dtype first), rounded to q's dtype: what the
torch backend's gather gives.

Each program runs an online softmax in fp32 over its keys in tiles of TILE_N keys (a tile
may span several cache blocks: each key looks up its own block id). Scores are kept
in log2 units (scale * log2 e folded into the scale) so exp2 replaces exp.

Split-KV (``num_segments > 1``): segment s of a program covers an equal share of its key
tiles and writes fp32 partials (running max, sum, unnormalised output) instead of the
output; ``_reduce_segments_kernel`` merges them (up to SPLIT_MAX_SEGMENTS segments in one
program per query head). ``num_kv_splits`` says when.

Small-batch decode (issue 18). Decode attention is a pure stream of the KV cache, so its
speed is the share of copy bandwidth it reaches. An H200 measured (bf16, contexts >= 4k)
11-30% at batch 1, 44-56% at 8, 56-59% at 32 and 83-91% from 64 under the earlier rule
(>= 256 programs wanted, segments >= 512 keys, <= 16 of them, 32-key tiles): batch 1 x 8 KV
heads at 4k ran 8 x 8 = 64 programs, so half the 132 SMs idled and the busy half each had
one program, i.e. one 32-key load chain, in flight. Two changes, every number a constant
below for the next GPU run to tune:

* Split rule: a decode batch whose (sequence x KV head) programs are fewer than
  SPLIT_PROGRAMS_PER_SM x the SM count (read once from the device; SM_COUNT_DEFAULT on the
  CPU) is split into enough segments to reach that, at most SPLIT_MAX_SEGMENTS and none
  shorter than SPLIT_MIN_SEGMENT_LEN keys. Two programs per SM keep a second load chain
  per SM in flight while the first waits on memory; 128-key segments are one or two decode
  tiles, long enough that a program's fixed cost (finding its sequence, loading q, writing
  16 rows of fp32 partials: 8 KiB against the 64 KiB of K/V it streams at D = 128) stays
  small. The partials cost batch x H x segments x D x 4 bytes twice (write, then the
  reduction's read): at batch 1, 32 heads, 32 segments, D 128 that is 0.5 MiB against
  16 MiB of K/V at 4k.
* Decode tiles (``max_query_len == 1``): DECODE_TILE_N keys per step by the bytes of a key's
  row (bf16/fp16: 128 keys up to D = 64, 64 up to D = 128, 32 beyond; fp32 one step
  narrower), so a K plus V stage stays <= 32 KiB of shared memory and DECODE_NUM_STAGES
  stages fit, against PREFILL_TILE_N = 32 for batches
  with prompt rows, whose [BLOCK_M, TILE_N] score tiles are 4x taller. Keys and values are
  both loaded as [TILE_N, D] tiles, contiguous along the head dim (one cache row of a KV
  head is D adjacent elements), and K enters the dot transposed (``tl.trans``), so both
  loads vectorise the same way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_runtime.kernels.store_kv import kernel_view, quant_mode

# Tile shapes (see tile_shape): keys per inner-loop step, warps and software-pipeline stages.
PREFILL_TILE_N = 32
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 3  # Triton's CUDA defaults: the shapes measured before issue 18
# (largest bytes of one key's padded head-dim row, keys per step): a K + V stage of at most 32 KiB.
DECODE_TILE_N = ((128, 128), (256, 64), (1 << 30, 32))
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# Split-KV rule (see num_kv_splits).
SM_COUNT_DEFAULT = 132  # an H100 SXM: the CPU / interpreter value, so tests see one fixed rule
SPLIT_PROGRAMS_PER_SM = 2  # programs wanted per SM before a decode batch is left unsplit
SPLIT_MIN_SEGMENT_LEN = 128  # keys: shorter segments cost more in partials and launch than they save
SPLIT_MAX_SEGMENTS = 64  # the reduction holds [segments, D] fp32 in one program

_sm_count: int | None = None


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device, read once; SM_COUNT_DEFAULT
    without CUDA (the interpreter), so the rule stays a pure function of host integers."""
    global _sm_count
    if _sm_count is None:
        _sm_count = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                     if torch.cuda.is_available() else SM_COUNT_DEFAULT)
    return _sm_count


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                  num_sms: int | None = None) -> int:
    """Segments per context: 1 (single pass) unless the batch is decode-only and its
    (sequence x KV head) programs are fewer than SPLIT_PROGRAMS_PER_SM x ``num_sms``
    (default: this device's, see sm_count); then enough segments to reach that, at most
    SPLIT_MAX_SEGMENTS and none shorter than SPLIT_MIN_SEGMENT_LEN keys of the longest
    context. Host integers only (no device read past the SM count, fixed once), so a
    CUDA graph captured for a batch size keeps its count."""
    programs = num_seqs * num_kv_heads
    wanted = SPLIT_PROGRAMS_PER_SM * (num_sms or sm_count())
    if max_query_len > 1 or programs >= wanted:
        return 1
    return max(1, min(SPLIT_MAX_SEGMENTS, -(-wanted // programs), max_seq_len // SPLIT_MIN_SEGMENT_LEN))


def tile_shape(head_dim: int, max_query_len: int, element_size: int = 2) -> tuple[int, int, int]:
    """(TILE_N, num_warps, num_stages) for a launch: wide key tiles for decode-only batches
    (their score tile has BLOCK_M = 16ish rows, so the width is all that sizes each load),
    as wide as keeps a K + V stage within 32 KiB of shared memory for the cache's element size;
    today's 32-key tiles when prompt rows can fill BLOCK_M = 64."""
    if max_query_len > 1:
        return PREFILL_TILE_N, PREFILL_NUM_WARPS, PREFILL_NUM_STAGES
    row_bytes = triton.next_power_of_2(head_dim) * element_size
    tile_n = next(n for limit, n in DECODE_TILE_N if row_bytes <= limit)
    return tile_n, DECODE_NUM_WARPS, DECODE_NUM_STAGES


@triton.jit
def _fp8_value(x, QUANT: tl.constexpr):
    """fp32 of an fp8 cache tile: a float8_e4m3fn load converted (QUANT 1), or its e4m3 bits (uint8, QUANT 3)
    decoded: normals 2^(e-7) * (1 + m/8), subnormals m * 2^-9 (no NaN: the store never writes one)."""
    if QUANT == 1:
        value = x.to(tl.float32)
    else:
        bits = x.to(tl.int32)
        size = bits & 0x7F
        normal = ((((size >> 3) + 120) << 23) | ((size & 7) << 20)).to(tl.float32, bitcast=True)
        value = tl.where(size < 8, (size & 7).to(tl.float32) * 0.001953125, normal)
        value = tl.where(bits >= 128, -value, value)
    return value


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning ``tile``: the last i with query_start_loc[i] // BLOCK_Q + i <= tile."""
    lo = tile * 0
    hi = tile * 0 + num_seqs - 1  # tensors from the start: loop-carried values keep one type
    while lo < hi:
        mid = (lo + hi + 1) // 2
        owns = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid - 1)
    return lo


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, kv_scale_ptr,
    scale_log2, num_seqs, window, softcap,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_slot, stride_c_kv, stride_c_h, stride_bt, stride_s_slot, stride_s_kv,
    stride_pa_t, stride_pa_h, stride_pa_s, stride_pm_t, stride_pm_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    # Row r: query q_tile * BLOCK_Q + r // GROUP of the sequence, head r % GROUP of the group.
    row = tl.arange(0, BLOCK_M)
    query = q_tile * BLOCK_Q + row // GROUP
    head = kv_head * GROUP + row % GROUP
    row_ok = (row < BLOCK_Q * GROUP) & (query < q_len)
    position = ctx_len - q_len + query
    token = q_start + query
    dim = tl.arange(0, HEAD_DIM_P)
    dim_ok = dim < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dim[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys kv_start .. kv_end - 1 are visible to some query of the tile: from its first query's window
    # start (0 without a window) to its last query; a segment takes its share of those key tiles.
    kv_end = ctx_len - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    num_kv_tiles = tl.cdiv(kv_end, TILE_N)
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(ctx_len - q_len + q_tile * BLOCK_Q - window + 1, 0)
    first_tile = kv_start // TILE_N
    if SPLIT:
        per_segment = tl.cdiv(num_kv_tiles - first_tile, tl.num_programs(2))
        first = first_tile + tl.program_id(2) * per_segment
        last = tl.minimum(first + per_segment, num_kv_tiles)
    else:
        first = first_tile
        last = num_kv_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = cache_ptr + kv_head * stride_c_h
    for kv_tile in range(first, last):
        key = kv_tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = (key < kv_end) & (key >= kv_start)  # masked keys load as 0: no slot outside the window read
        block = tl.load(table + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + key % BLOCK_SIZE  # int64: slot * stride overflows int32 in big caches
        # K and V as [TILE_N, D]: each key's row is D adjacent elements, so both loads vectorise along D.
        kv_row = kv_base + slot[:, None] * stride_c_slot + dim[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(kv_row, mask=kv_mask, other=0.0)
        v = tl.load(kv_row + stride_c_kv, mask=kv_mask, other=0.0)
        if QUANT == 1 or QUANT == 3:
            k = (_fp8_value(k, QUANT) * tl.load(kv_scale_ptr)).to(q_ptr.dtype.element_ty)
            v = (_fp8_value(v, QUANT) * tl.load(kv_scale_ptr + 1)).to(q_ptr.dtype.element_ty)
        elif QUANT == 2:
            scale_row = kv_scale_ptr + slot * stride_s_slot + kv_head
            k_scale = tl.load(scale_row, mask=key_ok, other=0.0)
            v_scale = tl.load(scale_row + stride_s_kv, mask=key_ok, other=0.0)
            # The scale rounded to q's dtype first, as kv_quant.dequantize (int8 times it is exact in fp32).
            k_scale = k_scale.to(q_ptr.dtype.element_ty).to(tl.float32)
            v_scale = v_scale.to(q_ptr.dtype.element_ty).to(tl.float32)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q_ptr.dtype.element_ty)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:  # c * tanh(x / c) of the natural-units score x, kept in log2 units (tanh via exp2: any x)
            s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp2(2.0 * s / softcap) + 1.0))
        visible = key[None, :] <= position[:, None]
        if SLIDING:
            visible = visible & (key[None, :] > position[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key so far keeps m = -inf; measuring from 0 then gives
        # exp2(-inf) = 0 instead of exp2(-inf - -inf) = NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        segment = tl.program_id(2)
        stats = token * stride_pm_t + head * stride_pm_h + segment
        tl.store(part_max_ptr + stats, m_i, mask=row_ok)
        tl.store(part_sum_ptr + stats, l_i, mask=row_ok)
        partial = part_acc_ptr + token[:, None] * stride_pa_t + head[:, None] * stride_pa_h \
            + segment * stride_pa_s + dim[None, :]
        tl.store(partial, acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        l_i = tl.where(row_ok, l_i, 1.0)  # padding rows: avoid 0 / 0 (they are not stored)
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_segments,
    stride_o_t, stride_o_h, stride_pa_t, stride_pa_h, stride_pa_s, stride_pm_t, stride_pm_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SEGMENTS_P: tl.constexpr,
):
    """One program per (token, query head): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - max m)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    segment = tl.arange(0, SEGMENTS_P)
    segment_ok = segment < num_segments
    stats = token * stride_pm_t + head * stride_pm_h + segment
    m = tl.load(part_max_ptr + stats, mask=segment_ok, other=float("-inf"))
    total = tl.load(part_sum_ptr + stats, mask=segment_ok, other=0.0)
    # Finite: segment 0 always holds the first key the query sees (key 0, or its window's first). Empty
    # segments have m = -inf, weight 0.
    weight = tl.exp2(m - tl.max(m, axis=0))
    dim = tl.arange(0, HEAD_DIM_P)
    dim_ok = dim < HEAD_DIM
    acc = tl.load(part_acc_ptr + token * stride_pa_t + head * stride_pa_h + segment[:, None] * stride_pa_s
                  + dim[None, :], mask=segment_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dim, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


def _block_shape(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per program and queries per tile. 16 rows (tl.dot's minimum)
    when queries are short, so a decode wastes little; 64 when prompt chunks can fill them."""
    block_m = 64 if max_query_len * group >= 64 else 16
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_query_len: int,
                    scale: float, num_splits: int = 1, out: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every query in ``q`` ([T, H, D]) over its sequence's paged context
    (layout in the module docstring); returns ``out`` ([T, H, D], q's dtype). ``window > 0``: each query
    over its last ``window`` positions; ``softcap > 0``: scores soft-capped at it; ``kv_scale``: an 8-bit
    cache's scales.

    ``max_query_len`` is a host-side upper bound on any sequence's query count (it picks
    the tile shape); ``num_splits > 1`` runs the split-KV variant with that many segments.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    assert kv_cache.shape[1] == 2 and kv_cache.shape[3] == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q = _block_shape(group, max_query_len)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    quant = quant_mode(kv_cache)
    assert (kv_scale is not None) == bool(quant), "an 8-bit cache needs its scales, a model-dtype one none"
    # An 8-bit tile is widened to q's dtype before the dots: size the tiles by that.
    tile_n, num_warps, num_stages = tile_shape(head_dim, max_query_len, q.element_size() if quant
                                               else kv_cache.element_size())
    scales = kv_scale if quant else kv_cache
    per_slot = quant == 2
    split = num_splits > 1
    assert num_splits <= SPLIT_MAX_SEGMENTS, "the reduction is sized for SPLIT_MAX_SEGMENTS"
    if split:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused: the SPLIT branch is compiled out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, out, kernel_view(kv_cache, quant), query_start_loc, seq_lens, block_tables,
        part_acc, part_max, part_sum, scales,
        scale * 1.4426950408889634, num_seqs, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
        scales.stride(0) if per_slot else 0, scales.stride(1) if per_slot else 0,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_max.stride(0), part_max.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=tile_n, BLOCK_SIZE=block_size, SPLIT=split, SLIDING=window > 0, SOFTCAP=softcap > 0, QUANT=quant,
        # fp32 models get fp32 products, not TF32 (10-bit mantissa) tensor-core ones.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_splits,
            out.stride(0), out.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_max.stride(0), part_max.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SEGMENTS_P=triton.next_power_of_2(num_splits),
        )
    return out
