"""Paged attention with the Triton kernels: the CUDA path.

Same call as the torch backend (``paged_attention(q, k, v, kv_cache, meta, scale)``),
its own metadata. A step's flat batch is B varlen causal queries: scheduled item i
contributes its ``num_scheduled`` tokens at positions ``start .. start + num_scheduled - 1``
and attends to its whole context 0 .. that position through its block table. Decodes,
prompt chunks (after earlier chunks or prefix-cache hits) and speculative verification
(the last token plus its drafts) are all that one case, in any order, in one launch.
Cache layout and kernel contract: ``paged_runtime/kernels/attention.py``.

Everything here imports without Triton; the kernels are imported on first use
(see ``paged_runtime.kernels`` for why).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from paged_runtime.core.scheduler import ScheduledRequest


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is stored (-1: padding, skipped)
    query_start_loc: torch.Tensor  # [B + 1] int32: item i's tokens are rows [i] .. [i + 1] of the batch
    seq_lens: torch.Tensor  # [B] int32: item i's context length, its new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32, zero-padded past each item's blocks
    block_size: int
    # Host-side bounds, so tile shapes and the split rule need no device read.
    max_query_len: int
    max_seq_len: int
    num_kv_splits: int | None = None  # None: kernels.attention.num_kv_splits decides per call

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, self, scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Stores k/v into the cache, returns [T, H, D]."""
    from paged_runtime.kernels import attention, store_kv

    store_kv.store_kv(k, v, kv_cache, meta.slot_mapping)
    splits = meta.num_kv_splits or attention.num_kv_splits(
        meta.seq_lens.shape[0], kv_cache.shape[2], meta.max_query_len, meta.max_seq_len)
    return attention.paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                     meta.block_size, meta.max_query_len, scale, splits)


def build_metadata(items: Sequence[ScheduledRequest], block_size: int,
                   device: torch.device) -> tuple[np.ndarray, TritonAttentionMetadata]:
    """Positions of the step's tokens (item after item, in ``items`` order) and their metadata.

    Item i computes ``num_scheduled`` tokens from position ``start`` with blocks ``block_ids``.
    Built with array ops over the whole batch; the only per-item Python is reading the fields.
    """
    counts = np.fromiter((s.num_scheduled for s in items), np.int64, len(items))
    starts = np.fromiter((s.start for s in items), np.int64, len(items))
    query_start_loc = np.zeros(len(items) + 1, np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    owner = np.repeat(np.arange(len(items)), counts)
    positions = starts[owner] + np.arange(len(owner)) - query_start_loc[owner]
    seq_lens = starts + counts
    tables = _block_tables([s.block_ids for s in items])
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    to = lambda a, dtype: torch.from_numpy(a.astype(dtype)).to(device)
    meta = TritonAttentionMetadata(to(slots, np.int64), to(query_start_loc, np.int32), to(seq_lens, np.int32),
                                   to(tables, np.int32), block_size, int(counts.max()), int(seq_lens.max()))
    return positions, meta


def _block_tables(block_ids: list[list[int]]) -> np.ndarray:
    """Rows of block ids, zero-padded to the longest (the kernel never reads past a context)."""
    lens = np.fromiter(map(len, block_ids), np.int64, len(block_ids))
    tables = np.zeros((len(block_ids), int(lens.max())), np.int32)
    tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
        (b for ids in block_ids for b in ids), np.int32, int(lens.sum()))
    return tables
