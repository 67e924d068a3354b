"""Token bitmasks of a step's constrained rows, filled on a helper thread while the model runs.

A row's mask needs only the request's token history (complete before the forward pass: the step's inputs are
written first) and, for a speculating request, its drafts (known once the drafter has run). So the runner
starts the fill before the forward pass and waits for it just before sampling: the grammar work overlaps
the model instead of adding to the step. Steps without a constrained request start nothing.

Masks are xgrammar's layout: int32 [rows, ceil(vocab / 32)], bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed; unconstrained rows are not listed (and not masked).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from paged_runtime.worker.request_states import CachedRequest


@dataclass(slots=True)
class GrammarMasks:
    sample_rows: list[int]  # constrained rows of the step's sampling batch
    sample: torch.Tensor  # [len(sample requests), words]
    spec_rows: list[int]  # constrained rows of the verification logits (k + 1 per speculating request)
    spec: torch.Tensor  # [total verified positions, words]


class GrammarMaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self.num_words = -(-vocab_size // 32)
        self._pool: ThreadPoolExecutor | None = None

    def start(self, sampled: list[CachedRequest], speculating: list[tuple[CachedRequest, list[int]]]
              ) -> Future | None:
        """Fill the masks of ``sampled`` (one row each) and ``speculating`` ((request, drafts): k + 1 rows
        each) in the background; None when none of them is constrained."""
        if not any(r.grammar is not None for r in sampled) and not any(r.grammar is not None for r, _ in speculating):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._pool.submit(self.fill, sampled, speculating)

    def fill(self, sampled: list[CachedRequest], speculating: list[tuple[CachedRequest, list[int]]]) -> GrammarMasks:
        sample = torch.full((len(sampled), self.num_words), -1, dtype=torch.int32)
        sample_rows = [row for row, request in enumerate(sampled) if _fill_one(request, sample, row, None)]
        spec = torch.full((sum(len(d) + 1 for _, d in speculating), self.num_words), -1, dtype=torch.int32)
        spec_rows, first = [], 0
        for request, drafts in speculating:
            if _fill_one(request, spec, first, drafts):
                spec_rows.extend(range(first, first + len(drafts) + 1))
            first += len(drafts) + 1
        return GrammarMasks(sample_rows, sample, spec_rows, spec)


def _fill_one(request: CachedRequest, bitmask: torch.Tensor, row: int, drafts: list[int] | None) -> bool:
    """Bring the request's matcher up to date and fill its row(s); False when no mask applies."""
    grammar = request.grammar
    if grammar is None:
        return False
    grammar.sync(request.token_ids, request.num_prompt_tokens)
    if not grammar.active:
        return False
    if drafts is None:
        grammar.fill(bitmask, row)
    else:
        grammar.fill_speculative(bitmask, row, drafts)
    return True
