"""Paged attention with the compiled CPU kernels: the CPU path when the kernels are on.

Query rows (decodes, each verification's last token and drafts, and the tokens of
small prompt chunks) are attended by ``paged_runtime::cpu_paged_decode_attention``
straight from the paged cache, each row over its own causal context (the step's
store happens before any row attends, so a row sees the rows before it): no gather,
no padding, no mask, so consecutive such rows form one group. A sliding-window
layer's rows read only their last W tokens (the kernel starts at the window's block:
O(W) per row), a soft-capped layer's scores are capped in the kernel.

A prompt chunk goes to the kernel's rows too when its queries times its context are at most
``SMALL_CHUNK`` (128 x 128) or its context is at most ``TILED_CONTEXT`` (512) tokens: the kernel attends a
chunk's rows in tiles of 8 that read each key and value once for all of them, each row's bits as alone. A
longer chunk goes to ``paged_runtime::cpu_paged_prompt_attention`` (flash attention: the chunk's context packed
once per KV head, then blocked products with an online softmax), where SDPA's blocked products beat the tiles:
flash is 1.1-1.6x the tiles and about even to 1.3x SDPA there (`benchmarks/cpu_attention.py --prompts`, 2-core
Zen 3). Flash is also 1.05-1.5x the tiles from 128 x 128 to 512 x 512, but its online softmax rounds
differently from the rows, and the default model's answer to the README's question (a 37-token prompt) is a
near-tie that it flips (measured: "L'Étoile, ..." instead of Paris), so short chunks keep the rows' bits.

A step of rows only (no prompt chunk) is ``rows_only``: the runner's compiled decode
step (``worker/cpu_decode_plan.py``) may then run every decoder layer in one call,
reading ``decode_rows`` and ``slot_mapping`` from here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_runtime.attention.torch_backend import AttentionMetadata
from paged_runtime.batch import StepBatch
from paged_runtime.kernels import cpu as cpu_kernels


_UNIT_FP8_SCALES = torch.ones(2)  # (k_scale, v_scale) = 1: fp8 values read as they are


def _read_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor | None:
    """The scales the kernels read the cache with: an fp8 cache's are applied by the caller (None), so unit ones."""
    return _UNIT_FP8_SCALES if kv_scale is None and kv_cache.dtype == torch.float8_e4m3fn else kv_scale


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
        return cpu_kernels.cpu_paged_decode_attention(q, kv_cache, self.block_tables, self.context_lens,
                                                      self.block_size, scale, window or 0, softcap or 0.,
                                                      _read_scale(kv_cache, kv_scale))


@dataclass(slots=True)
class PromptChunk:
    """One request's prompt chunk of ``num_rows`` rows from ``row_start``: the last queries of its context."""
    row_start: int
    num_rows: int
    block_table: torch.Tensor  # [max_blocks] int64: the request's table
    context_len: int
    block_size: int

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, window: int | None = None,
               softcap: float | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_kernels.cpu_paged_prompt_attention(q, kv_cache, self.block_table, self.context_len,
                                                      self.block_size, scale, window or 0, softcap or 0.,
                                                      _read_scale(kv_cache, kv_scale))


@dataclass(slots=True)
class CpuAttentionMetadata(AttentionMetadata):
    positions: torch.Tensor | None = None  # [T] int64
    decode_rows: DecodeRows | None = None
    rows_only: bool = False
    block_size: int = 0

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


SMALL_CHUNK = 128 * 128  # queries x context of a prompt chunk the row kernel attends (see above)
TILED_CONTEXT = 512  # the longest context of a prompt chunk the row kernel attends whatever its queries


def build_metadata(batch: StepBatch, device: torch.device) -> CpuAttentionMetadata:
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
    num_rows = batch.num_decodes + batch.num_verifies
    rows = np.arange(batch.num_items) < num_rows
    rows |= (batch.query_lens * batch.seq_lens <= SMALL_CHUNK) | (batch.seq_lens <= TILED_CONTEXT)
    groups = []
    for first, end in _runs(rows):  # consecutive items alike: one row-kernel group, or one flash call a chunk
        if rows[first]:
            span = slice(int(batch.query_start_loc[first]), int(batch.query_start_loc[end]))
            groups.append(DecodeRows(span.start, to(batch.block_tables[batch.row_owner[span]]),
                                     to(batch.positions[span] + 1), batch.block_size))
        else:
            groups += [PromptChunk(int(batch.query_start_loc[i]), int(batch.query_lens[i]),
                                   to(batch.block_tables[i]), int(batch.seq_lens[i]), batch.block_size)
                       for i in range(first, end)]
    rows_only = num_rows == batch.num_items  # no prompt chunk: the compiled decode step may take it
    return CpuAttentionMetadata(to(batch.slot_mapping), groups, [], to(batch.positions),
                                groups[0] if rows_only else None, rows_only, batch.block_size)


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[first, end) of each run of equal consecutive flags."""
    edges = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(flags)]
    return list(zip(bounds[:-1], bounds[1:]))
