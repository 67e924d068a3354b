"""One step's flat batch: built once by the model runner, read by every attention backend.

Items (one per request in the step) come in this order: single-token decodes, then
verifications (a request's last token followed by its draft tokens), then prompt
chunks; by ascending start within each kind, so neighbours have similar contexts.
Item i computes the tokens at positions ``starts[i] .. seq_lens[i] - 1``, which are
rows ``query_start_loc[i] .. query_start_loc[i + 1] - 1`` of the flat batch, and
attends to its context 0 .. each row's own position through its block table.

Token p of a request lives in slot ``table[p // block_size] * block_size + p % block_size``.
Everything here is host-side numpy, built with array operations over the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

DECODE, VERIFY, CHUNK = 0, 1, 2


@dataclass(slots=True)
class BatchItem:
    """``token_ids`` at positions ``start ..``, the last ``num_spec`` of them drafts to verify;
    ``table_row``: the request's row in the runner's block-table array."""
    start: int
    token_ids: list[int]
    num_spec: int
    table_row: int

    @property
    def kind(self) -> int:
        return VERIFY if self.num_spec else (DECODE if len(self.token_ids) == 1 else CHUNK)


def layout_order(items: list[BatchItem] | list[StepItem]) -> list[int]:
    """Indices of ``items`` in the batch's order: decodes, verifications, chunks; by start within each."""
    return sorted(range(len(items)), key=lambda i: (items[i].kind, items[i].start))


@dataclass(slots=True)
class StepBatch:
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: where each row's K/V is stored
    query_start_loc: np.ndarray  # [B + 1] int64
    seq_lens: np.ndarray  # [B] int64: each item's context length, this step's tokens included
    block_tables: np.ndarray  # [B, max_blocks] int32, zero past each item's blocks
    num_decodes: int
    num_verifies: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_items(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def starts(self) -> np.ndarray:
        return self.seq_lens - self.query_lens

    @property
    def row_owner(self) -> np.ndarray:
        """[T]: the item each row belongs to."""
        return np.repeat(np.arange(self.num_items), self.query_lens)

    @property
    def logits_end_rows(self) -> np.ndarray:
        """[B]: each item's last row (where its next token is sampled)."""
        return self.query_start_loc[1:] - 1

    def slots(self, item_rows: np.ndarray | slice, positions: np.ndarray) -> np.ndarray:
        """Slots of ``positions`` ([P] or [len(rows), P]) in the block tables of items ``item_rows``."""
        tables = self.block_tables[item_rows]
        if positions.ndim == 1:
            positions = np.broadcast_to(positions, (tables.shape[0], len(positions)))
        return (np.take_along_axis(tables, positions // self.block_size, axis=1).astype(np.int64) * self.block_size
                + positions % self.block_size)


def build_batch(items: list[BatchItem], tables: np.ndarray, block_size: int) -> StepBatch:
    """The batch of ``items`` (already in ``layout_order``); ``tables``: the runner's block-table rows."""
    counts = np.fromiter((len(s.token_ids) for s in items), np.int64, len(items))
    starts = np.fromiter((s.start for s in items), np.int64, len(items))
    query_start_loc = np.zeros(len(items) + 1, np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    owner = np.repeat(np.arange(len(items)), counts)
    positions = starts[owner] + np.arange(len(owner)) - query_start_loc[owner]
    seq_lens = starts + counts
    max_blocks = -(-int(seq_lens.max()) // block_size)
    block_tables = tables[[s.table_row for s in items], :max_blocks]
    slot_mapping = (block_tables[owner, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    token_ids = np.fromiter(chain.from_iterable(s.token_ids for s in items), np.int64, len(owner))
    kinds = [s.kind for s in items]
    return StepBatch(token_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                     kinds.count(DECODE), kinds.count(VERIFY), block_size)


@dataclass(slots=True)
class StepItem:
    """The runner's view of one scheduled request in a step: ``num_new_tokens`` of its own tokens from
    ``start`` (read from ``history``, the runner's copy of its tokens) and ``spec_token_ids`` after them."""
    request_id: str
    history: list[int]
    table_row: int
    start: int
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec: int = 0  # drafts to verify (a draft model's are filled into spec_token_ids by the runner)
    samples: bool = False

    @property
    def num_scheduled(self) -> int:
        return self.num_new_tokens + self.num_spec

    @property
    def kind(self) -> int:
        return VERIFY if self.num_spec else (DECODE if self.num_new_tokens == 1 else CHUNK)

    def batch_item(self) -> BatchItem:
        tokens = self.history[self.start:self.start + self.num_new_tokens] + self.spec_token_ids
        return BatchItem(self.start, tokens, self.num_spec, self.table_row)
