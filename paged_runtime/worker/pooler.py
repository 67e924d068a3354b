"""The runner's pooler: a pooling request's vector from its prompt's final hidden states (``pooling_params``).

A pooling item is a prompt chunk that never samples. LAST reads the row of the prompt's last token, in the
chunk that computes it. MEAN adds every chunk's rows (float32) into the request's ``pool_partial``, starting
over at position 0 (a preempted request is recomputed from there), and divides by the prompt length once the
last chunk is in; CLS keeps the row of position 0 there until the last chunk is in. MEAN and CLS requests never
start from prefix-cache hits, so the rows they read pass through here. The step's finished vectors come to the
host in one copy; truncation (``dimensions``) and L2 normalisation follow there, in float32. No logits are ever
computed for a pooling item.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.batch import StepItem
from paged_runtime.utils.device_inputs import to_host
from paged_runtime.worker.request_states import CachedRequest, RequestStates


def pool_items(items: list[StepItem], states: RequestStates, hidden: torch.Tensor,
               ends: np.ndarray) -> dict[int, list[float]]:
    """Item index -> the finished vector of each pooling item that completes its prompt this step."""
    done: dict[int, torch.Tensor] = {}
    for k, s in enumerate(items):
        state = states[s.request_id]
        if state.pooling is None:
            continue
        rows = hidden[ends[k] - s.num_scheduled:ends[k]]
        vector = _pool(state, rows, s.start, s.start + s.num_new_tokens >= state.num_prompt_tokens)
        if vector is not None:
            done[k] = vector
    if not done:
        return {}
    vectors, = to_host(torch.stack(list(done.values())))
    vectors = vectors.numpy()
    return {k: finish(vector, states[items[k].request_id].pooling) for k, vector in zip(done, vectors)}


def _pool(state: CachedRequest, rows: torch.Tensor, start: int, last: bool) -> torch.Tensor | None:
    """Take in one chunk's rows (prompt positions ``start ..``); the request's float32 vector once ``last`` (the
    chunk completes its prompt), else None."""
    kind = state.pooling.pooling_type
    if kind == "LAST":
        return rows[-1].float() if last else None
    if start == 0:
        state.pool_partial = None  # a preempted request starts over
    assert state.pool_partial is not None or start == 0, f"{kind} pooling must see position 0"
    if kind == "MEAN":
        chunk = rows.float().sum(dim=0)
        state.pool_partial = chunk if state.pool_partial is None else state.pool_partial + chunk
    elif start == 0:  # CLS: the first token's row
        state.pool_partial = rows[0].float()
    if not last:
        return None
    vector, state.pool_partial = state.pool_partial, None
    return vector / state.num_prompt_tokens if kind == "MEAN" else vector


def finish(vector: np.ndarray, pooling) -> list[float]:
    """Matryoshka truncation, then (if asked) L2 normalisation, in float32."""
    vector = np.asarray(vector, np.float32)
    if pooling.dimensions is not None:
        vector = vector[:pooling.dimensions]
    if pooling.normalize:
        vector = vector / max(np.float32(np.linalg.norm(vector)), np.float32(1e-12))
    return vector.astype(np.float32).tolist()
