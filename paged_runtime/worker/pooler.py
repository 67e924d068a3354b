"""The runner's pooler: a pooling request's vector from its prompt's final hidden states (``pooling_params``).

A pooling item is a prompt chunk that never samples. LAST reads the row of the prompt's last token, in the
chunk that computes it. MEAN adds every chunk's rows (float32) into the request's ``pool_sum``, starting over
at position 0 (a preempted request is recomputed from there), and divides by the prompt length once the last
chunk is in; MEAN requests never start from prefix-cache hits, so every prompt row passes through here. The
step's finished vectors come to the host in one copy; truncation (``dimensions``) and L2 normalisation follow
there, in float32. No logits are ever computed for a pooling item.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.batch import StepItem
from paged_runtime.utils.device_inputs import to_host
from paged_runtime.worker.request_states import RequestStates


def pool_items(items: list[StepItem], states: RequestStates, hidden: torch.Tensor,
               ends: np.ndarray) -> dict[int, list[float]]:
    """Item index -> the finished vector of each pooling item that completes its prompt this step."""
    done: dict[int, torch.Tensor] = {}
    for k, s in enumerate(items):
        state = states[s.request_id]
        pooling = state.pooling
        if pooling is None:
            continue
        rows = hidden[ends[k] - s.num_scheduled:ends[k]]
        last = s.start + s.num_new_tokens >= state.num_prompt_tokens
        if pooling.pooling_type == "MEAN":
            if s.start == 0:
                state.pool_sum = None
            assert state.pool_sum is not None or s.start == 0, "MEAN pooling must see every prompt row"
            chunk = rows.float().sum(dim=0)
            state.pool_sum = chunk if state.pool_sum is None else state.pool_sum + chunk
            if last:
                done[k] = state.pool_sum / state.num_prompt_tokens
                state.pool_sum = None
        elif last:
            done[k] = rows[-1].float()
    if not done:
        return {}
    vectors, = to_host(torch.stack(list(done.values())))
    vectors = vectors.numpy()
    return {k: finish(vector, states[items[k].request_id].pooling) for k, vector in zip(done, vectors)}


def finish(vector: np.ndarray, pooling) -> list[float]:
    """Matryoshka truncation, then (if asked) L2 normalisation, in float32."""
    vector = np.asarray(vector, np.float32)
    if pooling.dimensions is not None:
        vector = vector[:pooling.dimensions]
    if pooling.normalize:
        vector = vector / max(np.float32(np.linalg.norm(vector)), np.float32(1e-12))
    return vector.astype(np.float32).tolist()
