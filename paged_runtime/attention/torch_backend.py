"""Paged attention in plain PyTorch: the CPU path and the oracle for other backends.

Cache layout per layer: ``[num_blocks * block_size, 2, num_kv_heads, head_dim]``
with a slot's key at ``[slot, 0]`` and its value at ``[slot, 1]``: one gather
fetches both (measured ~2x faster than gathering K and V separately).

From the step's batch (``paged_runtime.batch``): decodes run in groups of similar
length as batched, masked attention over gathered context (grouping keeps the
padding small when lengths have long tails); verifications (last token + drafts)
in groups, one gather per request with causal queries; each prompt chunk on its
own with a causal mask aligned to the end of its context (earlier chunks and cache
hits come first). Gather indices and masks are built once per step, not per layer.

A sliding-window layer (``window``) narrows each mask to the query's last ``window``
positions (built on the first layer that asks, then kept for the step); a soft-capped
layer (``softcap``) attends in explicit ops, as Hugging Face's eager attention does, since
SDPA has no cap.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import numpy as np

from paged_runtime.batch import StepBatch
from paged_runtime.kernels import kv_quant


def in_window(query_pos: torch.Tensor, width: int, window: int) -> torch.Tensor:
    """[..., width] bool: key position j is inside the window of a query at ``query_pos`` (j > pos - window)."""
    return torch.arange(width, device=query_pos.device) > (query_pos[..., None] - window)


@dataclass(slots=True)
class PrefillChunk:
    query_start: int
    query_len: int
    # Slots of the whole context (cached prefix + this chunk); None when the
    # chunk is the whole context, so the fresh K/V are used directly.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [query_len, context_len] bool, True = attend (None: plain causal, L == C)
    context_len: int = 0
    window_masks: dict = field(default_factory=dict)

    def window_mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The causal mask narrowed to ``window`` (None: the plain one)."""
        if window is None or window >= self.context_len:
            return self.mask
        if window not in self.window_masks:
            base = self.mask if self.mask is not None else causal_mask(self.query_len, self.context_len, device)
            query_pos = torch.arange(self.context_len - self.query_len, self.context_len, device=device)
            self.window_masks[window] = base & in_window(query_pos, self.context_len, window)
        return self.window_masks[window]


@dataclass(slots=True)
class DecodeGroup:
    row_start: int
    slots: torch.Tensor  # [rows, max_context] gather index (padding points at a real slot, masked)
    mask: torch.Tensor | None  # [rows, 1, 1, max_context] bool, None when all lengths are equal
    context_lens: torch.Tensor | None = None  # [rows]
    window_masks: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, window: int | None = None,
               softcap: float | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return _decode_attention(q, kv_cache, self, scale, self.window_mask(window), softcap, kv_scale)

    def window_mask(self, window: int | None) -> torch.Tensor | None:
        if window is None or window >= self.slots.shape[1]:
            return self.mask
        if window not in self.window_masks:
            width = self.slots.shape[1]
            keep = in_window(self.context_lens - 1, width, window)
            if self.mask is not None:
                keep &= self.mask[:, 0, 0]
            self.window_masks[window] = keep[:, None, None, :]
        return self.window_masks[window]


@dataclass(slots=True)
class VerifyGroup:
    """Speculating requests: each one's last token and drafts (``lens[i]`` query rows, consecutive)
    attend to one gather of its context, causally, in one batched call."""
    row_start: int
    slots: torch.Tensor  # [requests, max_context] gather index (padding masked)
    query_index: torch.Tensor  # [rows] flat row -> position in the [requests * max_queries] grid
    max_queries: int
    mask: torch.Tensor  # [requests, 1, max_queries, max_context] bool
    query_pos: torch.Tensor | None = None  # [requests, max_queries] each query's position (padding: 0)
    window_masks: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.query_index.shape[0]

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, window: int | None = None,
               softcap: float | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        requests, width = self.slots.shape
        context = kv_quant.gather(kv_cache, kv_scale, self.slots.reshape(-1), q.dtype).view(
            requests, width, *kv_cache.shape[1:])
        grid = q.new_zeros(requests * self.max_queries, *q.shape[1:]).index_copy_(0, self.query_index, q)
        grid = grid.view(requests, self.max_queries, *q.shape[1:]).transpose(1, 2)  # [R, H, Q, D]
        out = attention(grid, context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2),
                        self.window_mask(window), scale, softcap)
        return out.transpose(1, 2).reshape(requests * self.max_queries, *q.shape[1:]).index_select(0, self.query_index)

    def window_mask(self, window: int | None) -> torch.Tensor:
        if window is None or window >= self.slots.shape[1]:
            return self.mask
        if window not in self.window_masks:  # padding rows (position 0) keep their one key
            self.window_masks[window] = self.mask & in_window(self.query_pos, self.slots.shape[1], window)[:, None]
        return self.window_masks[window]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is stored
    # One-token queries and verifications, the first rows (any group with ``row_start``, ``num_rows``
    # and ``attend``: the CPU kernel backend adds its own).
    decodes: list
    prefills: list[PrefillChunk]
    rows_only = False  # the CPU kernel backend's flag for the compiled decode step; never here

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               window: int | None = None, softcap: float | None = None,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, self, scale, window, softcap, kv_scale)


def decode_group(row_start: int, slots: torch.Tensor, context_lens: torch.Tensor) -> DecodeGroup:
    mask = None
    if int(context_lens.min()) != slots.shape[1]:
        positions = torch.arange(slots.shape[1], device=slots.device)
        mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    return DecodeGroup(row_start, slots, mask, context_lens)


def causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position context_len - query_len + i) sees keys 0..that position."""
    return torch.ones(query_len, context_len, dtype=torch.bool, device=device).tril(context_len - query_len)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Stores k/v into the cache, returns [T, H, D]. A cache in another dtype
    than q's (8-bit with its ``kv_scale``, or bfloat16 under float32: see ``kernels.kv_quant``) is converted on
    store and read back by every query, a whole prompt's included (as the other backends, which always read
    the cache)."""
    kv_quant.store(k, v, kv_cache, kv_scale, meta.slot_mapping)
    converted = kv_cache.dtype != q.dtype
    read_scale, fp8 = kv_scale, kv_cache.dtype == torch.float8_e4m3fn
    if fp8:
        # Per-tensor scales factor out of attention: q . (k_scale k) = (k_scale q) . k, and the output is
        # v_scale times the one over the raw values. The context is then read with one cast (e4m3 is exact in
        # any float dtype) instead of a dequantizing pass; with vLLM's default scales 1 nothing changes.
        q, read_scale = (q.float() * kv_scale[0]).to(q.dtype), None
    out = torch.empty_like(q)
    for group in meta.decodes:
        rows = slice(group.row_start, group.row_start + group.num_rows)
        out[rows] = group.attend(q[rows], kv_cache, scale, window, softcap, read_scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        mask = chunk.window_mask(window, q.device)
        if chunk.context_slots is None and not converted:
            out[rows] = _attend(q[rows], k[rows], v[rows], mask, scale, softcap)
        else:
            slots = meta.slot_mapping[rows] if chunk.context_slots is None else chunk.context_slots
            context = kv_quant.gather(kv_cache, read_scale, slots, q.dtype)
            out[rows] = _attend(q[rows], context[:, 0], context[:, 1], mask, scale, softcap)
    return (out.float() * kv_scale[1]).to(out.dtype) if fp8 else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None, causal: bool = False) -> torch.Tensor:
    """SDPA over q [B, H, Q, D], k / v [B, Hkv, C, D] (mask: bool, True = attend); with a soft cap, the
    same in explicit ops: scores * scale, capped, masked, softmax in float32, times v (Hugging Face's
    eager attention, step for step)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None = None) -> torch.Tensor:
    """One sequence: q [L, H, D], k/v [C, Hkv, D]; causal when mask is None (L == C)."""
    out = attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                    mask, scale, softcap, causal=mask is None)
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, scale: float,
                      mask: torch.Tensor | None, softcap: float | None = None,
                      kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Batched one-token queries over gathered context: q [B, H, D] -> [B, H, D]."""
    # index_select on the flattened index is ~2x faster than advanced indexing here.
    context = kv_quant.gather(kv_cache, kv_scale, group.slots.reshape(-1), q.dtype).view(
        *group.slots.shape, *kv_cache.shape[1:])
    keys = context[:, :, 0].transpose(1, 2)  # [B, Hkv, C, D], strided: SDPA takes it as is
    values = context[:, :, 1].transpose(1, 2)
    return attention(q.unsqueeze(2), keys, values, mask, scale, softcap).squeeze(2)


# ---- from the step's batch -------------------------------------------------------------------
# Decodes are attended in groups of this many rows (sorted by length), so one
# long context does not pad everyone else's gather to its length.
DECODE_GROUP_SIZE = 32


def build_metadata(batch: StepBatch, device: torch.device) -> AttentionMetadata:
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    decodes, verifies = batch.num_decodes, batch.num_verifies
    groups = [decode_groups(batch, first, min(first + DECODE_GROUP_SIZE, decodes), to)
              for first in range(0, decodes, DECODE_GROUP_SIZE)]
    groups += [verify_group(batch, first, min(first + DECODE_GROUP_SIZE, decodes + verifies), to)
               for first in range(decodes, decodes + verifies, DECODE_GROUP_SIZE)]
    chunks = [prefill_chunk(batch, i, to) for i in range(decodes + verifies, batch.num_items)]
    return AttentionMetadata(to(batch.slot_mapping), groups, chunks)


def decode_groups(batch: StepBatch, first: int, end: int, to) -> DecodeGroup:
    """Items first..end-1, one token each, sorted by length: the last is the longest."""
    lens = batch.seq_lens[first:end]
    gather = batch.slots(slice(first, end), np.arange(int(lens[-1])))
    return decode_group(int(batch.query_start_loc[first]), to(gather), to(lens))


def verify_group(batch: StepBatch, first: int, end: int, to) -> VerifyGroup:
    """Speculating items first..end-1: one context gather each, causal queries (rows padded to the longest)."""
    counts, starts = batch.query_lens[first:end], batch.starts[first:end]
    row_start, row_end = int(batch.query_start_loc[first]), int(batch.query_start_loc[end])
    owner = np.repeat(np.arange(end - first), counts)
    offset = np.arange(row_end - row_start) - (batch.query_start_loc[first:end] - row_start)[owner]
    width, queries = int((starts + counts).max()), int(counts.max())
    query_pos = starts[:, None] + np.arange(queries)[None, :]  # [R, Q]
    mask = np.arange(width)[None, None, :] <= query_pos[:, :, None]
    padding = np.arange(queries)[None, :] >= counts[:, None]
    mask[padding] = np.arange(width) == 0  # padding: see one key
    query_pos[padding] = 0
    return VerifyGroup(row_start, to(batch.slots(slice(first, end), np.arange(width))),
                       to(owner * queries + offset), queries, to(mask[:, None]), to(query_pos))


def prefill_chunk(batch: StepBatch, item: int, to) -> PrefillChunk:
    query_start, query_len = int(batch.query_start_loc[item]), int(batch.query_lens[item])
    context_len = int(batch.seq_lens[item])
    if batch.starts[item] == 0:
        return PrefillChunk(query_start, query_len, None, None, context_len)
    context = to(batch.slots(slice(item, item + 1), np.arange(context_len))[0])
    return PrefillChunk(query_start, query_len, context, causal_mask(query_len, context_len, context.device),
                        context_len)
