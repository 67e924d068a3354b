"""Gathers one step's sampling state into dense tensors for the sampler, from the runner's request states.

Per-request parameters live in the runner's per-row arrays (set once when a request
arrives) and are fancy-indexed out; penalties read each request's running output
counts. Every stage is built only when some row in the batch needs it, so an
all-greedy batch costs one small tensor.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.sample.sampler import HostRows, Penalties, SamplingMetadata
from paged_runtime.utils.device_inputs import to_device
from paged_runtime.worker.request_states import CachedRequest, RequestStates

PENALTY_FIELDS = ("rows", "token_ids", "output_counts", "repetition", "frequency", "presence")


def build_sampling_metadata(requests: list[CachedRequest], states: RequestStates) -> SamplingMetadata:
    """The step's sampling tensors, every dense one staged on the host and copied to the device in one
    non-blocking copy (``utils.device_inputs``); the per-row parameters' host copies go along (``host``)
    so the sampler partitions rows without a device read."""
    params = [r.params for r in requests]
    rows = np.fromiter((r.row for r in requests), np.int64, len(requests))
    all_greedy = all(p.greedy for p in params)
    host = HostRows(states.temperature[rows])
    if not all_greedy:
        if any(p.top_k for p in params):
            host.top_k = states.top_k[rows]
        if any(p.top_p < 1 for p in params):
            host.top_p = states.top_p[rows]
        if any(p.min_p > 0 for p in params):
            host.min_p = states.min_p[rows]
    arrays = {"temperature": host.temperature, "top_k": host.top_k, "top_p": host.top_p, "min_p": host.min_p}
    limited = [i for i, r in enumerate(requests) if r.blocked is not None]
    if limited:
        arrays["allowed_rows"] = np.array(limited, np.int64)
    bias = _logit_bias(requests)
    if bias is not None:
        arrays.update(zip(("bias_rows", "bias_cols", "bias_values"), bias))
    penalised = any(r.output_counts is not None for r in requests)
    if penalised:
        arrays.update(zip(PENALTY_FIELDS, _penalties(requests)))
    asked = [i for i, p in enumerate(params) if p.needs_logprobs]
    if asked and len(asked) < len(params):
        arrays["logprob_rows"] = np.array(asked, np.int64)
    present = {name: a for name, a in arrays.items() if a is not None}
    t = dict(zip(present, to_device(states.device, *present.values())))
    meta = SamplingMetadata(t["temperature"], all_greedy, [r.host_generator for r in requests], top_k=t.get("top_k"),
                            top_p=t.get("top_p"), min_p=t.get("min_p"), logprob_rows=t.get("logprob_rows"), host=host)
    if limited:
        meta.allowed = (t["allowed_rows"], torch.stack([requests[i].blocked for i in limited]))
    if bias is not None:
        meta.logit_bias = (t["bias_rows"], t["bias_cols"], t["bias_values"])
    if penalised:
        meta.penalties = Penalties(*(t[name] for name in PENALTY_FIELDS))
    if asked:
        meta.num_logprobs = max(params[i].logprobs or 0 for i in asked)
    return meta


def _logit_bias(requests: list[CachedRequest]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Sparse (rows, token ids, values), each (row, token) once: the request's logit_bias, -inf on the bad
    words' tokens that would complete one, and -inf on EOS / stop tokens while fewer than min_tokens have
    been generated. A token named twice gets the sum (-inf wins), as adding each entry in turn would."""
    added: dict[tuple[int, int], float] = {}

    def add(row: int, token_id: int, value: float) -> None:
        added[row, token_id] = added.get((row, token_id), 0.0) + value
    for row, request in enumerate(requests):
        p = request.params
        for token_id, bias in (p.logit_bias or {}).items():
            add(row, token_id, bias)
        for token_id in _bad_word_tokens(request):
            add(row, token_id, float("-inf"))
        if request.num_output_tokens < p.min_tokens:
            for token_id in sorted(request.eos_token_ids | set(p.stop_token_ids)):
                add(row, token_id, float("-inf"))
    if not added:
        return None
    (rows, cols), values = zip(*added), list(added.values())
    return np.array(rows, np.int64), np.array(cols, np.int64), np.array(values, np.float32)


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


def _penalties(requests: list[CachedRequest]) -> tuple[np.ndarray, ...]:
    """One entry per distinct token a penalised row has seen, with its count in the output: the
    ``Penalties`` fields in ``PENALTY_FIELDS`` order."""
    rows, token_ids, counts, per_row = [], [], [], []
    for row, request in enumerate(requests):
        seen = request.output_counts
        if seen is None:
            continue
        p = request.params
        rows.append(np.full(len(seen.token_ids), row)), token_ids.append(seen.token_ids), counts.append(seen.counts)
        per_row.append((len(seen.token_ids), p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    sizes = [n for n, *_ in per_row]
    joined = lambda parts, dtype: np.concatenate(parts).astype(dtype)
    per_entry = lambda k: np.repeat(np.array([x[k] for x in per_row], dtype=np.float32), sizes)
    return (joined(rows, np.int64), joined(token_ids, np.int64), joined(counts, np.float32),
            per_entry(1), per_entry(2), per_entry(3))
