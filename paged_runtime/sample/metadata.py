"""Gathers the per-request sampling state of one step into dense tensors for the sampler.

Every stage is built only when some row in the batch needs it, so an
all-greedy batch costs one small tensor.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.request import Request
from paged_runtime.sample.sampler import Penalties, SamplingMetadata


def build_sampling_metadata(requests: list[Request], generators: list[torch.Generator | None], vocab_size: int,
                            device: torch.device) -> SamplingMetadata:
    params = [r.params for r in requests]
    all_greedy = all(p.greedy for p in params)
    floats = lambda values: torch.tensor(values, dtype=torch.float32, device=device)
    meta = SamplingMetadata(floats([p.temperature for p in params]), all_greedy, generators)
    if not all_greedy:
        if any(p.top_k for p in params):
            meta.top_k = torch.tensor([p.top_k or vocab_size for p in params], device=device)
        if any(p.top_p < 1 for p in params):
            meta.top_p = floats([p.top_p for p in params])
        if any(p.min_p > 0 for p in params):
            meta.min_p = floats([p.min_p for p in params])
    meta.logit_bias = _logit_bias(requests, device)
    if any(p.has_penalties for p in params):
        meta.penalties = _penalties(requests, vocab_size, device)
    asked = [p.logprobs or 0 for p in params if p.needs_logprobs]
    meta.num_logprobs = max(asked) if asked else None
    return meta


def _logit_bias(requests: list[Request], device: torch.device):
    """Sparse (rows, token ids, values): the request's logit_bias, and -inf on EOS / stop
    tokens while fewer than min_tokens have been generated."""
    rows, cols, values = [], [], []
    for row, request in enumerate(requests):
        p = request.params
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row), cols.append(token_id), values.append(bias)
        if request.num_output_tokens < p.min_tokens:
            for token_id in sorted(request.eos_token_ids | set(p.stop_token_ids)):
                rows.append(row), cols.append(token_id), values.append(float("-inf"))
    if not rows:
        return None
    return (torch.tensor(rows, device=device), torch.tensor(cols, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def _penalties(requests: list[Request], vocab_size: int, device: torch.device) -> Penalties:
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    chosen = [requests[i] for i in rows]
    prompts = _padded([r.prompt_token_ids for r in chosen], vocab_size)
    outputs = _padded([r.output_token_ids for r in chosen], vocab_size)
    # One spare column takes the padding, then is dropped.
    prompt_mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, torch.from_numpy(prompts).to(device), True)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    index = torch.from_numpy(outputs).to(device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    floats = lambda values: torch.tensor(values, dtype=torch.float32, device=device)
    return Penalties(torch.tensor(rows, device=device), prompt_mask[:, :vocab_size], counts[:, :vocab_size],
                     floats([r.params.repetition_penalty for r in chosen]),
                     floats([r.params.frequency_penalty for r in chosen]),
                     floats([r.params.presence_penalty for r in chosen]))


def _padded(lists: list[list[int]], pad: int) -> np.ndarray:
    out = np.full((len(lists), max(1, max(len(x) for x in lists))), pad, dtype=np.int64)
    for row, values in zip(out, lists):
        row[:len(values)] = values
    return out
