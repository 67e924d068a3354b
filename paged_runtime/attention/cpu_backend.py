"""Paged attention with the compiled CPU kernels: the CPU path when the kernels are on.

One-token query rows (decodes, and each verification's last token and drafts) are
attended by ``paged_runtime::cpu_paged_decode_attention`` straight from the paged
cache, each row over its own causal context (the kernel's store happens before any
row attends, so a verification row sees the rows before it): no gather, no padding,
so one group holds them all. A sliding-window layer's rows read only their last W
tokens (the kernel starts at the window's block: O(W) per row), a soft-capped
layer's scores are capped in the kernel. Prompt chunks run as in the torch backend.

A step of rows only (no prompt chunk) is ``rows_only``: the CPU op set may then run
each decoder layer as one op, which reads ``decode_rows``, ``positions`` and
``slot_mapping`` from here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_runtime.attention.torch_backend import AttentionMetadata, prefill_chunk
from paged_runtime.batch import StepBatch
from paged_runtime.kernels import cpu as cpu_kernels


_UNIT_FP8_SCALES = torch.ones(2)  # (k_scale, v_scale) = 1: fp8 values read as they are


@dataclass(slots=True)
class DecodeRows:
    row_start: int
    block_tables: torch.Tensor  # [rows, max_blocks] int64: each row's request's table
    context_lens: torch.Tensor  # [rows] int64, counting the row's own token
    block_size: int

    @property
    def num_rows(self) -> int:
        return self.context_lens.shape[0]

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, window: int | None = None,
               softcap: float | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        if kv_scale is None and kv_cache.dtype == torch.float8_e4m3fn:  # the caller applies fp8's scales
            kv_scale = _UNIT_FP8_SCALES
        return cpu_kernels.cpu_paged_decode_attention(q, kv_cache, self.block_tables, self.context_lens,
                                                      self.block_size, scale, window or 0, softcap or 0.,
                                                      kv_scale)


@dataclass(slots=True)
class CpuAttentionMetadata(AttentionMetadata):
    positions: torch.Tensor | None = None  # [T] int64
    decode_rows: DecodeRows | None = None
    rows_only: bool = False
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def build_metadata(batch: StepBatch, device: torch.device) -> CpuAttentionMetadata:
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
    num_items = batch.num_decodes + batch.num_verifies
    num_rows = int(batch.query_start_loc[num_items])
    rows = None
    if num_rows:
        owner = batch.row_owner[:num_rows]
        rows = DecodeRows(0, to(batch.block_tables[owner]), to(batch.positions[:num_rows] + 1), batch.block_size)
    chunks = [prefill_chunk(batch, i, to) for i in range(num_items, batch.num_items)]
    return CpuAttentionMetadata(to(batch.slot_mapping), [rows] if rows else [], chunks, to(batch.positions), rows,
                                not chunks, batch.block_size)
