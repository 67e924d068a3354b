"""Penalties, logit bias and min_tokens change the logits exactly as vLLM defines them."""
from __future__ import annotations

import math

import torch

from paged_runtime.core.scheduler_output import NewRequestData
from paged_runtime.worker.sampling_metadata import build_sampling_metadata
from paged_runtime.sample.sampler import Sampler, apply_penalties
from paged_runtime.sampling_params import SamplingParams
from paged_runtime.worker.request_states import CachedRequest, RequestStates

VOCAB = 6


def request_with(prompt: list[int], output: list[int], **params) -> CachedRequest:
    """The runner's state of a request that has generated ``output`` (its first step's data, then one sampled
    token at a time, as the runner learns them)."""
    states = RequestStates(4, VOCAB, torch.device("cpu"))
    request = states.add(NewRequestData("r", prompt, len(prompt), SamplingParams(max_tokens=50, **params), 0,
                                        frozenset({5})))
    for token in output:
        request.write_tokens(len(request.token_ids), [token])
    STATES[id(request)] = states
    return request


STATES: dict[int, RequestStates] = {}


def processed_logits(request: CachedRequest, logits: torch.Tensor) -> torch.Tensor:
    meta = build_sampling_metadata([request], STATES[id(request)])
    out = logits.clone().unsqueeze(0)
    if meta.logit_bias is not None:
        rows, cols, values = meta.logit_bias
        out.index_put_((rows, cols), values, accumulate=True)
    if meta.penalties is not None:
        apply_penalties(out, meta.penalties)
    return out[0]


LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    request = request_with([0, 1], [1, 4], repetition_penalty=2.0)
    expected = torch.tensor([1.0, -2.0, 0.5, 3.0, -4.0, 1.0])  # 0 (prompt), 1 and 4 (output) seen
    assert torch.equal(processed_logits(request, LOGITS), expected)


def test_frequency_and_presence_penalties_count_output_only():
    request = request_with([2, 2, 3], [0, 0, 0, 4], frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([2.0 - 1.5 - 0.25, -1.0, 0.5, 3.0, -2.0 - 0.5 - 0.25, 1.0])
    assert torch.allclose(processed_logits(request, LOGITS), expected)


def test_logit_bias_is_added_and_clamped():
    request = request_with([1], [], logit_bias={2: 1.5, 3: -500})
    assert request.params.logit_bias == {2: 1.5, 3: -100.0}
    expected = torch.tensor([2.0, -1.0, 2.0, -97.0, -2.0, 1.0])
    assert torch.equal(processed_logits(request, LOGITS), expected)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    early = request_with([1], [0], min_tokens=3, stop_token_ids=[3])
    out = processed_logits(early, LOGITS)
    assert math.isinf(out[5]) and math.isinf(out[3]) and out[0] == 2.0
    done = request_with([1], [0, 0, 0], min_tokens=3, stop_token_ids=[3])
    assert torch.equal(processed_logits(done, LOGITS), LOGITS)


def test_greedy_with_penalty_picks_the_penalised_argmax():
    request = request_with([3], [], repetition_penalty=4.0)  # 3.0 / 4 = 0.75 < 2.0
    meta = build_sampling_metadata([request], STATES[id(request)])
    meta.temperature.zero_()
    meta.all_greedy = True
    assert Sampler(torch.Generator())(LOGITS.unsqueeze(0), meta).token_ids.tolist() == [0]


def test_output_counts_follow_overwritten_tokens():
    """The runner overwrites a token the scheduler changed (a beam's chosen token): the counts follow."""
    request = request_with([2, 2, 3], [0, 0, 0, 4], frequency_penalty=0.5, presence_penalty=0.25)
    request.write_tokens(6, [1, 4])  # position 6 was a 4: now 1, and a new 4 after it
    fresh = request_with([2, 2, 3], [0, 0, 0, 1, 4], frequency_penalty=0.5, presence_penalty=0.25)
    assert torch.equal(processed_logits(request, LOGITS), processed_logits(fresh, LOGITS))
    assert dict(zip(request.output_counts.token_ids, request.output_counts.counts)) == {2: 0, 3: 0, 0: 3, 4: 1, 1: 1}
