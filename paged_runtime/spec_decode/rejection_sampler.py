"""The exact rejection sampler of speculative decoding (Leviathan et al., 2023).

For a request with drafts d_1..d_k, the target model scored k + 1 positions:
p_j is its (processed) distribution after the real tokens and d_1..d_{j-1}.

- Greedy: accept d_j while it equals argmax p_j; then emit argmax p at the
  first mismatch (or the bonus argmax p_{k+1} when every draft passed). The
  output equals plain greedy decoding token for token.
- Random: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), the uniform
  drawn in float64; on rejection emit a token from normalize(max(p_j - q_j, 0))
  and stop; when all pass, emit a bonus token from p_{k+1}. n-gram drafts have
  q = one-hot, so acceptance is p_j(d_j) and the residual is p_j without d_j.
  The emitted tokens are distributed exactly as the target's own samples.

Draws come from the request's generator (its seed) or the engine's, so a
seeded request's tokens do not depend on its neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_runtime.sample.sampler import apply_min_p, apply_top_k_top_p, argmax_rows


@dataclass(slots=True)
class SpecRow:
    """One speculating request: its k + 1 target rows start at ``first_row``."""
    first_row: int
    drafts: list[int]
    draft_probs: torch.Tensor | None  # [k, V] q_j; None = one-hot (n-gram)
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    generator: torch.Generator | None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def target_probs(logits: torch.Tensor, row: SpecRow) -> torch.Tensor:
    """The distribution the target samples from at each of the row's positions (float32 logits in)."""
    logits = logits / row.temperature
    n, vocab = logits.shape
    if row.min_p > 0:
        logits = apply_min_p(logits, torch.full((n,), row.min_p, device=logits.device))
    top_k = torch.full((n,), row.top_k or vocab, device=logits.device) if 0 < row.top_k < vocab else None
    top_p = torch.full((n,), row.top_p, device=logits.device) if row.top_p < 1 else None
    return apply_top_k_top_p(logits, top_k, top_p).softmax(dim=-1)


class RejectionSampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SpecRow]) -> list[list[int]]:
        """Emitted tokens per row: the accepted drafts, then one token from the target."""
        greedy_ids = argmax_rows(logits).tolist() if any(r.greedy for r in rows) else None
        out = []
        for row in rows:
            scored = logits[row.first_row:row.first_row + len(row.drafts) + 1]
            if row.greedy:
                out.append(self._greedy(greedy_ids[row.first_row:row.first_row + len(row.drafts) + 1], row.drafts))
            else:
                out.append(self._random(target_probs(scored.float(), row), row))
        return out

    @staticmethod
    def _greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
        emitted = []
        for draft, target in zip(drafts, target_ids):
            emitted.append(target)
            if draft != target:
                return emitted
        emitted.append(target_ids[len(drafts)])
        return emitted

    def _random(self, p: torch.Tensor, row: SpecRow) -> list[int]:
        g = row.generator or self.generator
        emitted = []
        for j, draft in enumerate(row.drafts):
            q_draft = 1.0 if row.draft_probs is None else float(row.draft_probs[j, draft])
            u = torch.rand((), dtype=torch.float64, generator=g, device=p.device).item()
            if u * q_draft < float(p[j, draft]):
                emitted.append(draft)
                continue
            if row.draft_probs is None:
                residual = p[j].clone()
                residual[draft] = 0
            else:
                residual = (p[j] - row.draft_probs[j]).clamp_(min=0)
            if not bool(residual.sum() > 0):  # p == q up to rounding: p itself is the residual
                residual = p[j]
            emitted.append(sample_from(residual, g))
            return emitted
        emitted.append(sample_from(p[len(row.drafts)], g))
        return emitted


def sample_from(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from the (unnormalised) ``weights`` by the exponential race."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
