"""Turns the logits of the sampled rows into next tokens, batched, in vLLM's order.

1. raw logprobs (log_softmax of the model's logits) when any row asks for logprobs;
2. logit bias, and min_tokens (EOS and stop tokens masked until reached);
3. penalties: repetition over prompt + output, presence / frequency over output;
4. greedy rows take the argmax here;
5. temperature, min_p, top-k / top-p;
6. a random draw by the exponential race (argmax of p / Exp(1) noise): no
   ``multinomial``, no host sync. A seeded request draws its noise from its
   own generator, so its tokens do not depend on what else is in the batch;
7. logprobs of the sampled token (and its rank) and the top ones, from step 1.

Each stage runs only when some row needs it; per-request data is gathered
into dense tensors once per step by the model runner.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # [P] which rows have penalties
    prompt_mask: torch.Tensor  # [P, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [P, V] float: occurrences in the output so far
    repetition: torch.Tensor  # [P]
    frequency: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32, 0 = greedy
    all_greedy: bool
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    top_k: torch.Tensor | None = None  # [N] int64, vocab size = off
    top_p: torch.Tensor | None = None  # [N] float32, 1 = off
    min_p: torch.Tensor | None = None  # [N] float32, 0 = off
    # Sparse additions to the logits: (rows, token ids, values); -inf masks a token.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    num_logprobs: int | None = None  # top-k to gather for the rows that asked (max over them)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N]
    logprobs: torch.Tensor | None = None  # [N] raw logprob of the sampled token
    ranks: torch.Tensor | None = None  # [N] its rank (1 = most likely)
    top_ids: torch.Tensor | None = None  # [N, k]
    top_logprobs: torch.Tensor | None = None  # [N, k]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """vLLM's definitions: repetition divides positive / multiplies negative logits of seen
    tokens; frequency subtracts count * penalty; presence subtracts penalty once."""
    rows = logits[p.rows]
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = p.repetition.unsqueeze(1)
    rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
    rows -= p.frequency.unsqueeze(1) * p.output_counts
    rows -= p.presence.unsqueeze(1) * (p.output_counts > 0)
    logits[p.rows] = rows


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one's (done in logit space:
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p))."""
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


# Top-p looks for the nucleus among this many most likely tokens first; a full sort of the
# vocabulary (~100 ms for 64 rows of 49k here) is only the fallback for very flat rows.
_TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) every logit outside the row's top-k, then outside its top-p nucleus (the
    smallest set of most likely tokens whose mass reaches p). Rows with the filter off are untouched."""
    vocab = logits.shape[-1]
    if top_k is not None:
        rows = (top_k < vocab).nonzero().squeeze(1)
        if rows.numel():
            logits = logits.clone()
            logits[rows] = _top_k(logits[rows], top_k[rows])
    if top_p is not None:
        rows = (top_p < 1).nonzero().squeeze(1)
        if rows.numel():
            logits = logits.clone()
            logits[rows] = _top_p(logits[rows], top_p[rows])
    return logits


def _top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = k.clamp(min=1)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    top = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)
    cumulative = top.values.cumsum(dim=-1)
    if not bool((cumulative[:, -1] >= p).all()):
        return _top_p_sorted(logits, p)
    # Keep a token while the mass strictly above it is below p (the top token always stays).
    num_kept = ((cumulative - top.values) < p.unsqueeze(1)).sum(dim=-1)
    cutoff = top.values.gather(1, (num_kept - 1).unsqueeze(1))
    return logits.masked_fill(probs < cutoff, float("-inf"))


def _top_p_sorted(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    outside = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - p).unsqueeze(1)
    outside[:, -1] = False  # the top token always survives
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(outside, float("-inf")))


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.num_logprobs is not None else None
        if meta.logit_bias is not None or meta.penalties is not None:
            logits = logits.clone()
            if meta.logit_bias is not None:
                rows, cols, values = meta.logit_bias
                logits.index_put_((rows, cols), values, accumulate=True)
            if meta.penalties is not None:
                apply_penalties(logits, meta.penalties)
        tokens = logits.argmax(dim=-1)
        if not meta.all_greedy:
            tokens = torch.where(meta.temperature < 1e-5, tokens, self._sample(logits, meta))
        return self._with_logprobs(tokens, raw_logprobs, meta.num_logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(meta.temperature < 1e-5, 1.0, meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        probs = apply_top_k_top_p(logits, meta.top_k, meta.top_p).softmax(dim=-1)
        return probs.div_(self._exponential_noise(probs, meta.generators)).argmax(dim=-1)

    @staticmethod
    def _with_logprobs(tokens: torch.Tensor, raw: torch.Tensor | None, k: int | None) -> SamplerOutput:
        if raw is None:
            return SamplerOutput(tokens)
        sampled = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
        ranks = (raw > sampled.unsqueeze(1)).sum(dim=-1) + 1
        top = raw.topk(k, dim=-1) if k else None
        return SamplerOutput(tokens, sampled, ranks, top.indices if top else None, top.values if top else None)

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
