"""Turns the logits of the sampled rows into next tokens, batched, in vLLM's order.

0. structured-output token bitmasks (disallowed tokens to -inf), where vLLM applies its grammar
   bitmask: before the sampler, so even raw logprobs are those of the constrained distribution;
1. raw logprobs (log_softmax of the model's logits) for the rows that ask;
2. allowed_token_ids (every other token masked), bad words (a word's last token
   masked once the output ends with the rest of it), logit bias, and min_tokens
   (EOS and stop tokens masked until reached);
3. penalties: repetition over prompt + output, presence / frequency over output;
4. greedy rows take the argmax here;
5. temperature, min_p, top-k / top-p;
6. a random draw by the exponential race (argmax of p / Exp(1) noise): no
   ``multinomial``. A seeded request's noise comes from a seed it draws from its
   own generator each step, so its tokens do not depend on what else is in the batch;
7. logprobs of the sampled token (and its rank) and the top ones, from step 1.

Rows with a top-k / top-p / min_p filter are sampled among their most likely
candidates (a top-k of 64, then 1,024, then 8,192 tokens; a full sort for the
rare row whose support is wider still): a row's noise then covers only its
candidates instead of the whole vocabulary. Which rung a row's token comes from,
and what noise it draws, depends on that row alone, which keeps seeded draws
batch-invariant. Unfiltered rows race over the full vocabulary.

No device reads: greedy, sampled, filtered and top-k-only rows are told apart on
the host (``HostRows``, the request parameters), indices reach the device by
non-blocking copies, and a row's rung is picked on the device. The one exception:
when top-p / min_p rows are present, whether they fit the first rung is read back
once a step (their support depends on their logits).

Each stage runs only when some row needs it; per-request data is gathered
into dense (or, for penalties, sparse) tensors once per step by the model runner.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_runtime.utils.device_inputs import to_device


@dataclass(slots=True)
class Penalties:
    """Sparse: one entry per (row, token) the row has seen, in its prompt or its output."""
    rows: torch.Tensor  # [E] int64
    token_ids: torch.Tensor  # [E] int64
    output_counts: torch.Tensor  # [E] float: occurrences in the output so far (0: prompt only)
    repetition: torch.Tensor  # [E] the entry's row's penalty
    frequency: torch.Tensor  # [E]
    presence: torch.Tensor  # [E]


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32, 0 = greedy
    all_greedy: bool
    generators: list[torch.Generator | None]  # per row: a seeded row's host generator; None = the engine's generator
    top_k: torch.Tensor | None = None  # [N] int64, vocab size = off
    top_p: torch.Tensor | None = None  # [N] float32, 1 = off
    min_p: torch.Tensor | None = None  # [N] float32, 0 = off
    # allowed_token_ids: (rows [A] int64, blocked [A, V] bool: True where the row may not sample the token).
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # Sparse additions to the logits: (rows, token ids, values), each (row, token) pair once (summed on the host:
    # an accumulating index_put reads its indices' range back on CUDA); -inf masks a token (bad words, min_tokens).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    num_logprobs: int | None = None  # top-k to gather for the rows that asked (max over them)
    logprob_rows: torch.Tensor | None = None  # [L] the rows that asked; None = every row
    # Structured outputs: (constrained rows, int32 bitmask [N, ceil(V / 32)], xgrammar's layout).
    grammar_bitmask: tuple[list[int], torch.Tensor] | None = None
    host: HostRows | None = None  # host copies of temperature / top_k / top_p / min_p; None: read from the tensors


@dataclass(slots=True)
class HostRows:
    """Host copies of the per-row parameters (fancy-indexed from the runner's numpy arrays): the sampler
    tells greedy, filtered and top-k-only rows apart with these, never by reading the device."""
    temperature: np.ndarray  # [N] float32, 0 = greedy
    top_k: np.ndarray | None = None  # [N] int64, vocab size = off
    top_p: np.ndarray | None = None  # [N] float32, 1 = off
    min_p: np.ndarray | None = None  # [N] float32, 0 = off

    @classmethod
    def read(cls, meta: SamplingMetadata) -> HostRows:
        """From the metadata's tensors, for metadata built without host copies (a device read on CUDA)."""
        host = lambda t: t.cpu().numpy() if t is not None else None
        return cls(host(meta.temperature), host(meta.top_k), host(meta.top_p), host(meta.min_p))

    def take(self, rows: np.ndarray) -> HostRows:
        pick = lambda a: a[rows] if a is not None else None
        return HostRows(self.temperature[rows], pick(self.top_k), pick(self.top_p), pick(self.min_p))

    def data_dependent(self) -> np.ndarray:
        """[N] bool: a top-p or min_p filter, whose support depends on the row's logits."""
        out = np.zeros(len(self.temperature), dtype=bool)
        if self.top_p is not None:
            out |= self.top_p < 1
        if self.min_p is not None:
            out |= self.min_p > 0
        return out

    def filtered(self, vocab: int) -> np.ndarray:
        """[N] bool: a filter can make the row's support smaller than the vocabulary."""
        out = self.data_dependent()
        if self.top_k is not None:
            out |= self.top_k < vocab
        return out

    def top_k_fits(self, width: int, vocab: int) -> np.ndarray:
        """[N] bool: the row's top-k lies within its ``width`` best candidates (so its support does)."""
        if self.top_k is None:
            return np.zeros(len(self.temperature), dtype=bool)
        k = np.maximum(self.top_k, 1)
        return (k < vocab) & (k <= width)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N]
    logprobs: torch.Tensor | None = None  # [N] raw logprob of the sampled token
    ranks: torch.Tensor | None = None  # [N] its rank (1 = most likely)
    top_ids: torch.Tensor | None = None  # [N, k]
    top_logprobs: torch.Tensor | None = None  # [N, k]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of tied maxima; a NaN wins), as ``logits.argmax(dim=-1)`` gives it: ``max``'s
    indices follow the same contract and, on the CPU, take a third of argmax's time (measured on a 2-core Xeon:
    13 vs 39 us a row of SmolLM2's 49,152 logits, 128 rows, float32)."""
    return logits.max(dim=-1).indices


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: -inf on every token whose bit is clear in its row's mask (``bitmask[r]`` for ``logits[r]``),
    for the listed rows only. Bit ``t % 32`` of word ``t // 32`` stands for token ``t``."""
    if not rows:
        return
    at = _index(rows, logits.device)
    words = bitmask[at].to(logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    logits[at] = logits[at].masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """vLLM's definitions: repetition divides positive / multiplies negative logits of seen
    tokens; frequency subtracts count * penalty; presence subtracts penalty once. In place,
    touching only the seen (row, token) entries."""
    seen = logits[p.rows, p.token_ids]
    seen = torch.where(seen > 0, seen / p.repetition, seen * p.repetition)
    seen -= p.frequency * p.output_counts
    seen -= p.presence * (p.output_counts > 0)
    logits[p.rows, p.token_ids] = seen


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one's (done in logit space:
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p))."""
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) every logit outside the row's top-k (ties with the k-th kept), then outside
    its top-p nucleus: the smallest set of most likely tokens whose renormalised mass reaches p.
    Full-vocabulary reference; the sampler's candidate path gives the same support."""
    vocab = logits.shape[-1]
    if top_k is not None:
        rows = (top_k < vocab).nonzero().squeeze(1)
        if rows.numel():
            logits = logits.clone()
            k = top_k[rows].clamp(min=1)
            kth = logits[rows].topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            logits[rows] = logits[rows].masked_fill(logits[rows] < kth, float("-inf"))
    if top_p is not None:
        rows = (top_p < 1).nonzero().squeeze(1)
        if rows.numel():
            logits = logits.clone()
            sorted_logits, order = logits[rows].sort(dim=-1)  # ascending
            outside = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p[rows]).unsqueeze(1)
            outside[:, -1] = False  # the top token always survives
            logits[rows] = torch.empty_like(sorted_logits).scatter_(
                1, order, sorted_logits.masked_fill(outside, float("-inf")))
    return logits


# Candidate widths tried in turn for filtered rows; a row whose support fits in none is sorted whole.
_CANDIDATE_WIDTHS = (64, 1024, 8192)


@dataclass(slots=True)
class _Rows:
    """The sampled rows' own slice of the metadata (temperature already applied to ``logits``)."""
    logits: torch.Tensor  # [R, V]
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    seeds: list[int | None]  # this step's seed of a seeded row's noise; None: the engine's generator

    def take(self, index: np.ndarray, at: torch.Tensor) -> _Rows:
        """Rows ``index`` (host), ``at`` the same indices on the device."""
        if len(index) == self.logits.shape[0] and np.array_equal(index, np.arange(len(index))):
            return self
        pick = lambda t: t[at] if t is not None else None
        return _Rows(self.logits[at], pick(self.top_k), pick(self.top_p), [self.seeds[i] for i in index])


def _index(rows, device: torch.device) -> torch.Tensor:
    """Row indices (host) as an int64 tensor on ``device``, copied without a stream sync."""
    return to_device(device, np.asarray(rows, dtype=np.int64))[0]


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self._scratch = torch.Generator(device=generator.device)  # reseeded per seeded row per step

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        source = logits
        logits = logits.float()
        edits = (meta.grammar_bitmask, meta.allowed, meta.logit_bias, meta.penalties)
        if any(e is not None for e in edits) and logits.data_ptr() == source.data_ptr():
            logits = logits.clone()  # the caller's tensor stays untouched
        if meta.grammar_bitmask is not None:
            apply_token_bitmask(logits, *meta.grammar_bitmask)
        raw_logprobs = None
        if meta.num_logprobs is not None:
            asked = logits if meta.logprob_rows is None else logits[meta.logprob_rows]
            raw_logprobs = asked.log_softmax(dim=-1)
        if meta.allowed is not None:
            rows, blocked = meta.allowed
            logits[rows] = logits[rows].masked_fill(blocked, float("-inf"))
        if meta.logit_bias is not None:
            rows, cols, values = meta.logit_bias
            logits[rows, cols] += values  # pairs are unique: no accumulate, no device read
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        if meta.all_greedy:
            tokens = argmax_rows(logits)
        else:
            tokens = self._greedy_and_sampled(logits, meta)
        return self._with_logprobs(tokens, raw_logprobs, meta)

    def _greedy_and_sampled(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Rows are split on the host, from the request parameters (``meta.host``): no device read."""
        host = meta.host if meta.host is not None else HostRows.read(meta)
        greedy = host.temperature < 1e-5
        greedy_rows, sampled_rows = np.flatnonzero(greedy), np.flatnonzero(~greedy)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        greedy_at, at = to_device(logits.device, greedy_rows, sampled_rows)  # one copy for both
        if len(greedy_rows):
            tokens[greedy_at] = argmax_rows(logits[greedy_at])
        if len(sampled_rows):
            pick = lambda t: t[at] if t is not None else None
            scaled = logits[at].div_(meta.temperature[at].unsqueeze(1))
            if meta.min_p is not None:
                scaled = apply_min_p(scaled, meta.min_p[at])
            seeds = [self._seed(meta.generators[i]) for i in sampled_rows]
            tokens[at] = self._sample(_Rows(scaled, pick(meta.top_k), pick(meta.top_p), seeds),
                                      host.take(sampled_rows), logits.shape[-1])
        return tokens

    def _seed(self, generator: torch.Generator | None) -> int | None:
        """A seeded row's one draw from its own host generator this step (no device read)."""
        return None if generator is None else int(torch.randint(2**62, (1,), generator=generator))

    def _sample(self, rows: _Rows, host: HostRows, vocab: int) -> torch.Tensor:
        tokens = torch.empty(rows.logits.shape[0], dtype=torch.long, device=rows.logits.device)
        filtered = host.filtered(vocab)
        if filtered.any():
            self._sample_filtered(rows, host, np.flatnonzero(filtered), tokens)
        unfiltered = np.flatnonzero(~filtered)
        if len(unfiltered):
            at = _index(unfiltered, tokens.device)
            tokens[at] = self._sample_vocabulary(rows.take(unfiltered, at))
        return tokens

    def _sample_filtered(self, rows: _Rows, host: HostRows, pending: np.ndarray, tokens: torch.Tensor) -> None:
        """The candidate ladder. Each rung races the pending rows over their ``width`` most likely tokens
        and a row takes the token of the first rung it fits (decided on the device). Which rows go on
        to the next rung is decided on the host: a top-k-only row fits once k <= width (its support is
        known); a top-p / min_p row's fit depends on its logits, so the first rung's fits are read back
        once (the sampler's only device read, and only for such rows), and a row that missed it then
        stays in every later rung (its first fit still wins) rather than costing a read per rung."""
        vocab = rows.logits.shape[-1]
        data_dependent = host.data_dependent()
        settled = torch.zeros(rows.logits.shape[0], dtype=torch.bool, device=tokens.device)
        read = False
        for width in _CANDIDATE_WIDTHS + (vocab,):  # the whole vocabulary always fits
            if not len(pending):
                break
            at = _index(pending, tokens.device)
            fits, chosen = self._sample_candidates(rows.take(pending, at), width)
            fresh = fits & ~settled[at]
            tokens[at] = torch.where(fresh, chosen, tokens[at])
            settled[at] = settled[at] | fits
            if width >= vocab:
                break
            stays = ~host.top_k_fits(width, vocab)[pending]  # a top-k row within the width always fits
            dependent = data_dependent[pending] & stays
            if dependent.any() and not read:
                read = True
                stays[dependent] = ~np.asarray(fits.tolist(), dtype=bool)[dependent]
            pending = pending[stays]

    def _sample_candidates(self, rows: _Rows, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Race among each row's ``width`` most likely tokens. Returns (fits [R] bool, tokens [R]);
        a row fits when no token outside its candidates can be in its filtered support."""
        logits, vocab = rows.logits, rows.logits.shape[-1]
        width = min(width, vocab)
        # Descending; -inf (min_p) sorts last. A full-width top-k is a sort, and sort is no slower.
        values, ids = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
        keep = torch.isfinite(values)
        fits = ~keep[:, -1] if width < vocab else torch.ones_like(keep[:, 0])
        within = None
        if rows.top_k is not None:
            k = rows.top_k.clamp(min=1)
            within = (k < vocab) & (k <= width)
            kth = values.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
            keep &= ~within.unsqueeze(1) | (values >= kth)
            fits |= within
        if rows.top_p is not None:
            normaliser = logits.logsumexp(dim=-1, keepdim=True)
            if within is not None:  # top-p after top-k renormalises over the top-k set (known when within)
                top_k_mass = values.masked_fill(~keep, float("-inf")).logsumexp(dim=-1, keepdim=True)
                normaliser = torch.where(within.unsqueeze(1), top_k_mass, normaliser)
            probs = (values - normaliser).exp().masked_fill(~keep, 0)
            cumulative = probs.cumsum(dim=-1)
            active = rows.top_p < 1
            # Keep a token while the mass strictly above it is below p (the top token always stays).
            keep &= ((cumulative - probs) < rows.top_p.unsqueeze(1)) | ~active.unsqueeze(1)
            closes = active & (cumulative[:, -1] >= rows.top_p)
            if rows.top_k is not None:  # the renormalised mass is only right when top-k lies within
                closes &= (rows.top_k >= vocab) | (rows.top_k <= width)
            fits |= closes
        weights = (values - values[:, :1]).exp().masked_fill(~keep, 0)
        noise = self._noise(weights, rows.seeds)
        return fits, ids.gather(1, (weights / noise).argmax(dim=-1, keepdim=True)).squeeze(1)

    def _sample_vocabulary(self, rows: _Rows) -> torch.Tensor:
        """Unfiltered rows: the race over every token."""
        probs = rows.logits.softmax(dim=-1)
        return argmax_rows(probs.div_(self._noise(probs, rows.seeds)))

    def _noise(self, like: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
        """Exp(1) noise shaped like ``like``. A seeded row's comes from a scratch generator seeded with its
        seed for this step (one draw from its own generator, ``_seed``, whatever rungs it tries), so it
        depends on the request alone. Only the row's support (a prefix of its candidates) weighs in the
        race, and a CPU generator's first n values do not depend on how many are drawn, so drawing the
        whole row draws what drawing only the support would, and needs no device read of its size."""
        shared = [i for i, seed in enumerate(seeds) if seed is None]
        noise = torch.empty_like(like)
        if len(shared) == len(seeds):
            return noise.exponential_(generator=self.generator)
        if shared:
            noise[_index(shared, like.device)] = torch.empty(len(shared), like.shape[1], device=like.device
                                                            ).exponential_(generator=self.generator)
        for i, seed in enumerate(seeds):
            if seed is not None:
                self._scratch.manual_seed(seed)
                noise[i].exponential_(generator=self._scratch)
        return noise

    @staticmethod
    def _with_logprobs(tokens: torch.Tensor, raw: torch.Tensor | None, meta: SamplingMetadata) -> SamplerOutput:
        """Logprob outputs are [N] (and [N, k]); rows that did not ask hold zeros."""
        if raw is None:
            return SamplerOutput(tokens)
        rows = meta.logprob_rows
        picked = tokens if rows is None else tokens[rows]
        sampled = raw.gather(1, picked.unsqueeze(1)).squeeze(1)
        ranks = (raw > sampled.unsqueeze(1)).sum(dim=-1) + 1
        top = raw.topk(meta.num_logprobs, dim=-1) if meta.num_logprobs else None
        if rows is None:
            return SamplerOutput(tokens, sampled, ranks, top.indices if top else None, top.values if top else None)
        def scatter(values: torch.Tensor) -> torch.Tensor:
            out = values.new_zeros((tokens.shape[0],) + values.shape[1:])
            out[rows] = values
            return out
        return SamplerOutput(tokens, scatter(sampled), scatter(ranks), scatter(top.indices) if top else None,
                             scatter(top.values) if top else None)
