"""Turns the logits of the sampled rows into next tokens, batched.

Greedy rows take the argmax of the raw logits. Random rows are divided by
their temperature, filtered by top-k / top-p, and drawn with the exponential
race (argmax of p / Exp(1) noise), which needs no ``multinomial`` and no host
sync. A seeded request draws its noise from its own generator, so its tokens
do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_k: torch.Tensor | None  # [N] int64, vocab size = off; None when no row filters
    top_p: torch.Tensor | None  # [N] float32, 1 = off
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    all_greedy: bool


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) every logit outside the row's top-k and top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - top_p).unsqueeze(1)
        outside[:, -1] = False  # the top token always survives
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_tokens
        greedy = meta.temperature < 1e-5
        scaled = logits / torch.where(greedy, 1.0, meta.temperature).unsqueeze(1)
        probs = apply_top_k_top_p(scaled, meta.top_k, meta.top_p).softmax(dim=-1)
        sampled = probs.div_(self._exponential_noise(probs, meta.generators)).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            return noise.exponential_(generator=self.generator)
        if shared:
            rows = torch.tensor(shared, device=probs.device)
            noise[rows] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return noise
