"""Draft-model proposer: a smaller model with the target's vocabulary and its own paged KV cache.

The draft shares the target's block tables (same slots, its own cache
tensors), so the scheduler's allocation covers both. Each engine step, before
the target's forward pass:

1. catch-up: the draft runs over every scheduled request's real tokens (prompt
   chunks and decode tokens, plus any accepted draft whose draft KV is missing),
   which keeps its cache in step with the target's and yields d_1 from the last
   real position of each speculating request;
2. k - 1 single-token passes, batched across the speculating requests, yield
   d_2..d_k (greedy requests take the draft's argmax; others sample the draft's
   processed distribution q with the request's generator, and keep q for the
   rejection sampler).

``computed[r]`` is how many leading positions of request r hold valid draft
KV. After verification it covers the accepted drafts the draft itself ran
(all but d_k), so the next catch-up starts one token early when all k passed.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from paged_runtime.batch import BatchItem, StepItem, layout_order
from paged_runtime.kernels import kv_quant
from paged_runtime.sample.sampler import argmax_rows
from paged_runtime.spec_decode.rejection_sampler import SpecRow, sample_from, target_probs

# forward(model, items in layout order) -> hidden states: the runner's batch builder and backend.
Forward = Callable[[object, list[BatchItem]], torch.Tensor]


class DraftModelProposer:
    def __init__(self, model, kv_caches: list[torch.Tensor]) -> None:
        """``model``: its attention layers bound to ``kv_caches``, which share the target's slot numbering."""
        self.model, self.kv_caches = model, kv_caches
        self.computed: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_quant.copy_slots(self.kv_caches, src, dst)

    @torch.inference_mode()
    def propose(self, items: list[StepItem], spec_rows: dict[int, SpecRow], forward: Forward,
                generator: torch.Generator) -> None:
        """Catch up on ``items``; fill drafts (and q for random rows) of the speculating ones.

        ``spec_rows`` maps an index into ``items`` to its SpecRow (drafts empty on entry)."""
        catch_up = []
        for s in items:
            real_end = s.start + s.num_new_tokens
            start = min(self.computed.get(s.request_id, s.start), s.start)
            catch_up.append(BatchItem(start, s.history[start:real_end], 0, s.table_row))
            self.computed[s.request_id] = real_end
        order = layout_order(catch_up)
        ends = np.cumsum([len(catch_up[i].token_ids) for i in order])
        last_row = {i: int(ends[k]) - 1 for k, i in enumerate(order)}
        hidden = forward(self.model, [catch_up[i] for i in order])
        speculating = sorted(spec_rows)
        if not speculating:
            return
        logits = self.model.compute_logits(hidden[[last_row[i] for i in speculating]])
        self._draw(logits, [spec_rows[i] for i in speculating], generator)
        for step in range(1, max(items[i].num_spec for i in speculating)):
            active = [i for i in speculating if items[i].num_spec > step]
            passes = [BatchItem(items[i].start + step, spec_rows[i].drafts[-1:], 0, items[i].table_row)
                      for i in active]
            order = layout_order(passes)
            hidden = forward(self.model, [passes[k] for k in order])
            back = np.argsort(order)
            logits = self.model.compute_logits(hidden[torch.as_tensor(back)])
            self._draw(logits, [spec_rows[i] for i in active], generator)

    def accepted(self, item: StepItem, num_accepted: int) -> None:
        """The draft KV is valid up to the last accepted draft the draft model ran itself."""
        self.computed[item.request_id] = item.start + 1 + min(num_accepted, item.num_spec - 1)

    @staticmethod
    def _draw(logits: torch.Tensor, rows: list[SpecRow], generator: torch.Generator) -> None:
        """Append one draft token to each row; random rows also append its q to ``draft_probs``."""
        greedy_ids = argmax_rows(logits).tolist()
        for j, row in enumerate(rows):
            if row.greedy:
                row.drafts.append(greedy_ids[j])
                continue
            q = target_probs(logits[j:j + 1], row)
            row.drafts.append(sample_from(q[0], row.generator or generator))
            row.draft_probs = q if row.draft_probs is None else torch.cat([row.draft_probs, q])
