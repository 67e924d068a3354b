"""Bidirectional attention without a KV cache: the backend of encoder-only models (``ModelFamily.encoder_only``).

Each item of an encoder's step is one request's whole prompt: the engine never chunks an encoder's prompt and
never starts it from the prefix cache (``engine/core.py``), so a request's tokens attend to each other in both
directions and to nothing else (block-diagonal attention over the flat batch). Nothing is stored: no request
ever continues, so its keys and values are not needed after the step (the model's ``EncoderAttention`` layers
hold no cache, and its blocks cost no memory: ``worker/kv_budget.py``).

The items are padded to the longest into one ``[items, heads, longest, head_dim]`` batch, one SDPA call per
layer; a key mask hides the padding (a padding query row attends to its item's real keys and is dropped).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_runtime.attention.torch_backend import attention
from paged_runtime.batch import StepBatch


@dataclass(slots=True)
class EncoderMetadata:
    grid_rows: torch.Tensor  # [T]: each flat row's place in the padded [items * longest] grid
    num_items: int
    longest: int
    mask: torch.Tensor | None  # [items, 1, 1, longest] bool, True = a real key; None when every item is as long
    rows_only = False  # the runner's compiled CPU decode step runs decoder layers: never here

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: None, scale: float,
               window: None = None, softcap: None = None, kv_scale: None = None) -> torch.Tensor:
        """q [T, H, D], k / v [T, Hkv, D] -> [T, H, D]: each row over every row of its own item."""
        assert kv_cache is None and window is None and softcap is None, "an encoder layer keeps no cache"
        out = attention(self._pad(q), self._pad(k), self._pad(v), self.mask, scale, None)
        return out.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, self.grid_rows)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [items, H, longest, D], zeros past each item's end."""
        grid = x.new_zeros(self.num_items * self.longest, *x.shape[1:]).index_copy_(0, self.grid_rows, x)
        return grid.view(self.num_items, self.longest, *x.shape[1:]).transpose(1, 2)


def build_metadata(batch: StepBatch, device: torch.device) -> EncoderMetadata:
    # The scheduler's promise for an encoder (whole prompts, no cache hits): without it a chunk would attend
    # to part of its prompt only, and silently give a wrong vector.
    assert not batch.starts.any(), "an encoder's prompt is computed whole, from position 0, in one step"
    lens = batch.query_lens
    longest = int(lens.max())
    owner = batch.row_owner
    grid_rows = owner * longest + np.arange(batch.num_tokens) - batch.query_start_loc[owner]
    mask = None
    if (lens != longest).any():
        mask = torch.from_numpy(np.arange(longest)[None, :] < lens[:, None])[:, None, None, :].to(device)
    return EncoderMetadata(torch.from_numpy(grid_rows).to(device), batch.num_items, longest, mask)
