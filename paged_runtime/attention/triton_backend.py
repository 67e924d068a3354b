"""Paged attention with the Triton kernels: the CUDA path.

Same call as the torch backend (``paged_attention(q, k, v, kv_cache, meta, scale)``),
its own metadata. A step's flat batch (``paged_runtime.batch``) is B varlen causal
queries: item i's tokens attend to their context 0 .. their positions through
its block table (a sliding-window layer: only the last W of them, the kernel skipping the
blocks before; a soft-capped layer: capped scores). Decodes,
prompt chunks (after earlier chunks or prefix-cache hits) and speculative verification
(the last token plus its drafts) are all that one case, in any order, in one launch.
Cache layout and kernel contract: ``paged_runtime/kernels/attention.py``.

Everything here imports without Triton; the kernels are ``paged_runtime::triton_*``
ops whose implementations import Triton on first use (see ``paged_runtime.kernels``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_runtime.batch import StepBatch
from paged_runtime.kernels import triton_ops
from paged_runtime.utils.device_inputs import to_device


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
    rows_only = False  # the CPU kernel backend's flag; never here

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               window: int | None = None, softcap: float | None = None,
               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, self, scale, window, softcap, kv_scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: TritonAttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Stores k/v into the cache, returns [T, H, D]; each query over its
    last ``window`` positions (None: all), scores soft-capped at ``softcap`` (None: not); an 8-bit cache
    quantized on store and dequantized on read with ``kv_scale`` (``kernels.kv_quant``)."""
    triton_ops.store_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
    # A window shortens what each query reads: split by the keys actually read.
    span = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
    splits = meta.num_kv_splits or triton_ops.num_kv_splits(
        meta.seq_lens.shape[0], kv_cache.shape[2], meta.max_query_len, span)
    return triton_ops.paged_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                      meta.block_size, meta.max_query_len, scale, splits, window or 0,
                                      softcap or 0., kv_scale)


def build_metadata(batch: StepBatch, device: torch.device) -> TritonAttentionMetadata:
    """Every item is one causal varlen query: decodes, prompt chunks and verifications alike.
    The four index arrays reach the device in one non-blocking copy (``utils.device_inputs``)."""
    host = lambda a, dtype: np.ascontiguousarray(a, dtype=dtype)
    tensors = to_device(device, host(batch.slot_mapping, np.int64), host(batch.query_start_loc, np.int32),
                        host(batch.seq_lens, np.int32), host(batch.block_tables, np.int32))
    return TritonAttentionMetadata(*tensors, batch.block_size, int(batch.query_lens.max()), int(batch.seq_lens.max()))
