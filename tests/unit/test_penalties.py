"""Penalties, logit bias and min_tokens change the logits exactly as vLLM defines them."""
from __future__ import annotations

import math

import torch

from paged_runtime.request import Request
from paged_runtime.sample.metadata import build_sampling_metadata
from paged_runtime.sample.sampler import Sampler, apply_penalties
from paged_runtime.sampling_params import SamplingParams

VOCAB = 6


def request_with(prompt: list[int], output: list[int], **params) -> Request:
    request = Request("r", prompt, SamplingParams(max_tokens=50, **params), 0, 50, frozenset({5}))
    for token in output:
        request.append_token(token)
    return request


def processed_logits(request: Request, logits: torch.Tensor) -> torch.Tensor:
    meta = build_sampling_metadata([request], [None], VOCAB, torch.device("cpu"))
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
    meta = build_sampling_metadata([request], [None], VOCAB, torch.device("cpu"))
    meta.temperature.zero_()
    meta.all_greedy = True
    assert Sampler(torch.Generator())(LOGITS.unsqueeze(0), meta).token_ids.tolist() == [0]
