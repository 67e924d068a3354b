"""Gathers one step's sampling state into dense tensors for the sampler, from the runner's request states.

Per-request parameters live in the runner's per-row arrays (set once when a request
arrives) and are fancy-indexed out; penalties read each request's running output
counts. Every stage is built only when some row in the batch needs it, so an
all-greedy batch costs one small tensor.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.sample.sampler import Penalties, SamplingMetadata
from paged_runtime.worker.request_states import CachedRequest, RequestStates


def build_sampling_metadata(requests: list[CachedRequest], states: RequestStates) -> SamplingMetadata:
    params = [r.params for r in requests]
    rows = np.fromiter((r.row for r in requests), np.int64, len(requests))
    device = states.device
    tensor = lambda a: torch.from_numpy(a[rows]).to(device)
    all_greedy = all(p.greedy for p in params)
    meta = SamplingMetadata(tensor(states.temperature), all_greedy, [r.generator for r in requests])
    if not all_greedy:
        if any(p.top_k for p in params):
            meta.top_k = tensor(states.top_k)
        if any(p.top_p < 1 for p in params):
            meta.top_p = tensor(states.top_p)
        if any(p.min_p > 0 for p in params):
            meta.min_p = tensor(states.min_p)
    limited = [i for i, r in enumerate(requests) if r.blocked is not None]
    if limited:
        meta.allowed = (torch.tensor(limited, device=device), torch.stack([requests[i].blocked for i in limited]))
    meta.logit_bias = _logit_bias(requests, device)
    if any(r.output_counts is not None for r in requests):
        meta.penalties = _penalties(requests, device)
    asked = [i for i, p in enumerate(params) if p.needs_logprobs]
    if asked:
        meta.num_logprobs = max(params[i].logprobs or 0 for i in asked)
        if len(asked) < len(params):
            meta.logprob_rows = torch.tensor(asked, device=device)
    return meta


def _logit_bias(requests: list[CachedRequest], device: torch.device):
    """Sparse (rows, token ids, values): the request's logit_bias, -inf on the bad words' tokens that would
    complete one, and -inf on EOS / stop tokens while fewer than min_tokens have been generated."""
    rows, cols, values = [], [], []
    for row, request in enumerate(requests):
        p = request.params
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row), cols.append(token_id), values.append(bias)
        for token_id in _bad_word_tokens(request):
            rows.append(row), cols.append(token_id), values.append(float("-inf"))
        if request.num_output_tokens < p.min_tokens:
            for token_id in sorted(request.eos_token_ids | set(p.stop_token_ids)):
                rows.append(row), cols.append(token_id), values.append(float("-inf"))
    if not rows:
        return None
    return (torch.tensor(rows, device=device), torch.tensor(cols, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _bad_word_tokens(request: CachedRequest) -> list[int]:
    """vLLM's bad words: a one-token word is always blocked; a longer one's last token is blocked when the
    output so far ends with its other tokens (the prompt does not count)."""
    sequences = request.params.bad_words_token_ids
    if not sequences:
        return []
    tokens, num_output = request.token_ids, request.num_output_tokens
    blocked = []
    for ids in sequences:
        prefix = len(ids) - 1
        if prefix == 0 or (num_output >= prefix and tokens[len(tokens) - prefix:] == ids[:-1]):
            blocked.append(ids[-1])
    return blocked


def _penalties(requests: list[CachedRequest], device: torch.device) -> Penalties:
    """One entry per distinct token a penalised row has seen, with its count in the output."""
    rows, token_ids, counts, per_row = [], [], [], []
    for row, request in enumerate(requests):
        seen = request.output_counts
        if seen is None:
            continue
        p = request.params
        rows.append(np.full(len(seen.token_ids), row)), token_ids.append(seen.token_ids), counts.append(seen.counts)
        per_row.append((len(seen.token_ids), p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    sizes = [n for n, *_ in per_row]
    tensor = lambda parts, dtype: torch.from_numpy(np.concatenate(parts).astype(dtype)).to(device)
    per_entry = lambda k: torch.from_numpy(np.repeat(np.array([x[k] for x in per_row], dtype=np.float32),
                                                     sizes)).to(device)
    return Penalties(tensor(rows, np.int64), tensor(token_ids, np.int64), tensor(counts, np.float32),
                     per_entry(1), per_entry(2), per_entry(3))
