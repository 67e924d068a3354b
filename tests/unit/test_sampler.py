"""Sampler: exact filtering, and empirical frequencies that match the filtered distribution."""
from __future__ import annotations

import pytest
import torch

from paged_runtime.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p, argmax_rows

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
CHI2_P001_DF = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # critical values at p = 0.001


def draw(logits: torch.Tensor, num: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
         min_p: float = 0.0, seed: int = 0) -> torch.Tensor:
    rows = logits.expand(num, -1).clone()
    meta = SamplingMetadata(
        temperature=torch.full((num,), temperature),
        top_k=torch.full((num,), top_k or logits.numel()) if top_k else None,
        top_p=torch.full((num,), top_p) if top_p < 1 else None,
        min_p=torch.full((num,), min_p) if min_p else None,
        generators=[None] * num, all_greedy=False)
    return Sampler(torch.Generator().manual_seed(seed))(rows, meta).token_ids


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert torch.all(support[samples]), "sampled a token outside the filtered support"
    counts = torch.bincount(samples, minlength=probs.numel()).double()[support]
    expected = probs[support].double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def expected_probs(temperature: float, keep: list[int]) -> torch.Tensor:
    scaled = LOGITS / temperature
    mask = torch.full_like(scaled, float("-inf"))
    mask[keep] = 0
    return (scaled + mask).softmax(-1)


def test_top_k_and_top_p_mask_exactly():
    logits = LOGITS.expand(3, -1)
    out = apply_top_k_top_p(logits, torch.tensor([2, 6, 6]), torch.tensor([1.0, 0.8, 1.0]))
    assert torch.isfinite(out).tolist() == [
        [True, True, False, False, False, False],
        # probs 0.557, 0.205, 0.124, 0.075, ...: the smallest set with mass >= 0.8 is the top 3
        [True, True, True, False, False, False],
        [True] * 6]
    assert torch.equal(out[2], LOGITS)


def test_temperature_frequencies_match():
    samples = draw(LOGITS, 40_000, temperature=0.7)
    stat, df = chi_square(samples, expected_probs(0.7, list(range(6))))
    assert stat < CHI2_P001_DF[df], stat


def test_top_k_frequencies_match():
    samples = draw(LOGITS, 40_000, temperature=1.3, top_k=3)
    stat, df = chi_square(samples, expected_probs(1.3, [0, 1, 2]))
    assert stat < CHI2_P001_DF[df], stat


def test_top_p_frequencies_match():
    samples = draw(LOGITS, 40_000, temperature=1.0, top_p=0.8)
    stat, df = chi_square(samples, expected_probs(1.0, [0, 1, 2]))
    assert stat < CHI2_P001_DF[df], stat


def test_min_p_frequencies_match():
    # probs at T=1: 0.557 0.205 0.124 0.075 0.028 0.004; min_p 0.2 keeps p >= 0.111: the top 3.
    samples = draw(LOGITS, 40_000, temperature=1.0, min_p=0.2)
    stat, df = chi_square(samples, expected_probs(1.0, [0, 1, 2]))
    assert stat < CHI2_P001_DF[df], stat


def test_min_p_applies_before_top_p():
    # min_p first leaves the top 3 (renormalised: 0.630 0.232 0.138); top_p 0.8 then keeps 2.
    samples = draw(LOGITS, 40_000, temperature=1.0, min_p=0.2, top_p=0.8)
    stat, df = chi_square(samples, expected_probs(1.0, [0, 1]))
    assert stat < CHI2_P001_DF[df], stat


def test_a_wrong_filter_would_be_caught():
    # top-k 3 draws checked against a top-4 distribution must fail: the test has teeth.
    samples = draw(LOGITS, 40_000, temperature=1.0, top_k=3)
    stat, df = chi_square(samples, expected_probs(1.0, [0, 1, 2, 3]))
    assert stat > CHI2_P001_DF[df]


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    meta = SamplingMetadata(torch.tensor([0.0, 0.0]), all_greedy=False, generators=[None, None])
    assert Sampler(torch.Generator().manual_seed(0))(rows, meta).token_ids.tolist() == [0, 5]


def test_greedy_tokens_are_the_first_maximum_as_argmax_gives_it():
    """Ties go to the lowest token id and a NaN logit wins (torch.argmax's contract), with rows long enough to be
    split into vector chunks and over threads, whatever the batch holds."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 49_153), generator=gen).float()  # every row holds many tied maxima
    logits[5, [7, 40_000]] = float("nan")
    logits[6] = float("-inf")
    logits[7, [9, 49_152]] = float("inf")
    expected = logits.argmax(dim=-1)
    assert (expected[5], expected[6], expected[7]) == (7, 0, 9)
    assert torch.equal(argmax_rows(logits), expected)
    meta = SamplingMetadata(torch.zeros(64), all_greedy=True, generators=[None] * 64)
    assert torch.equal(Sampler(torch.Generator().manual_seed(0))(logits, meta).token_ids, expected)


def test_per_row_generators_are_independent_of_neighbours():
    gen = lambda: torch.Generator().manual_seed(42)
    alone = Sampler(torch.Generator().manual_seed(0))(
        LOGITS.expand(1, -1).clone(), SamplingMetadata(torch.ones(1), False, [gen()])).token_ids
    crowd = Sampler(torch.Generator().manual_seed(5))(
        LOGITS.expand(3, -1).clone(), SamplingMetadata(torch.ones(3), False, [None, gen(), None])).token_ids
    assert crowd[1] == alone[0]


@pytest.fixture(params=[(64, 1024), (4,), (2,), ()], ids=["candidates", "width-4", "width-2", "sorted"])
def candidate_widths(request, monkeypatch):
    """Runs a test with each candidate-width ladder: every filtered row fits (V = 6 <= 64), the
    3-token supports fit, none fits (a full sort after a try), and the full sort alone."""
    from paged_runtime.sample import sampler
    monkeypatch.setattr(sampler, "_CANDIDATE_WIDTHS", request.param)
    return request.param


@pytest.mark.parametrize("filters, keep", [
    (dict(temperature=1.3, top_k=3), [0, 1, 2]),
    (dict(temperature=1.0, top_p=0.8), [0, 1, 2]),
    (dict(temperature=1.0, min_p=0.2), [0, 1, 2]),
    (dict(temperature=1.0, min_p=0.2, top_p=0.8), [0, 1]),
    # top-p over the renormalised top 4 (0.614 0.203 0.116 0.067) drops token 3; over the full softmax it would not.
    (dict(temperature=0.9, top_k=4, top_p=0.92), [0, 1, 2]),
])
def test_filtered_frequencies_match_on_every_path(candidate_widths, filters, keep):
    samples = draw(LOGITS, 40_000, **filters)
    stat, df = chi_square(samples, expected_probs(filters["temperature"], keep))
    assert stat < CHI2_P001_DF[df], stat


def test_candidate_path_support_equals_the_full_vocabulary_filter(monkeypatch):
    """On a 300-token vocabulary, whatever width a row fits in, it only ever samples tokens the
    full-vocabulary reference filter keeps, and it reaches all of a small support."""
    from paged_runtime.sample import sampler
    torch.manual_seed(1)
    logits = torch.randn(6, 300) * 4
    top_k = torch.tensor([5, 300, 300, 40, 300, 2])
    top_p = torch.tensor([1.0, 0.5, 0.95, 0.9, 0.999, 1.0])
    reference = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p))
    for widths in [(8,), (8, 64), (300,)]:
        monkeypatch.setattr(sampler, "_CANDIDATE_WIDTHS", widths)
        num = 3000
        rows = logits.repeat_interleave(num, 0)
        meta = SamplingMetadata(torch.ones(6 * num), False, [None] * (6 * num), top_k=top_k.repeat_interleave(num),
                                top_p=top_p.repeat_interleave(num))
        tokens = Sampler(torch.Generator().manual_seed(0))(rows, meta).token_ids.view(6, num)
        hit = torch.zeros_like(reference).scatter_(1, tokens, True)
        assert not (hit & ~reference).any(), widths
        assert torch.equal(hit[0], reference[0]) and torch.equal(hit[5], reference[5])


def test_seeded_rows_ignore_which_path_their_neighbours_take():
    torch.manual_seed(2)
    logits = torch.randn(4, 300) * 3
    gen = lambda: torch.Generator().manual_seed(7)
    # Row 1 fits in the candidates; row 0 is unfiltered (vocabulary path); rows 2-3 are flat and fall back.
    crowd_logits = torch.stack([logits[0], logits[1], torch.zeros(300), torch.zeros(300)])
    crowd_meta = lambda: SamplingMetadata(torch.ones(4), False, [None, gen(), gen(), None],
                                          top_k=torch.tensor([300, 10, 300, 300]),
                                          top_p=torch.tensor([1.0, 0.9, 0.99, 0.5]))
    alone_meta = lambda: SamplingMetadata(torch.ones(1), False, [gen()], top_k=torch.tensor([10]),
                                          top_p=torch.tensor([0.9]))
    for seed in range(20):
        alone = Sampler(torch.Generator().manual_seed(seed))(logits[1:2].clone(), alone_meta()).token_ids
        crowd = Sampler(torch.Generator().manual_seed(seed + 100))(crowd_logits.clone(), crowd_meta()).token_ids
        assert crowd[1] == alone[0]


def test_top_p_one_keeps_the_whole_top_k():
    # Rounding in a cumulative sum must not drop the last top-k token when top-p is off.
    logits = -0.01 * torch.arange(50.0).unsqueeze(0)
    meta = SamplingMetadata(torch.ones(20_000), False, [None] * 20_000, top_k=torch.full((20_000,), 7),
                            top_p=torch.ones(20_000))
    tokens = Sampler(torch.Generator().manual_seed(0))(logits.expand(20_000, -1).clone(), meta).token_ids
    assert set(tokens.tolist()) == set(range(7))


@pytest.mark.parametrize("widths", [(64, 1024), (2, 8, 64)], ids=["first-rung", "after-two-misses"])
def test_a_seeded_row_advances_its_generator_by_one_draw_whatever_its_support(widths, monkeypatch):
    """Support sizes, and so the rung a row fits, can shift at a numerically close nucleus boundary
    (batch shape changes reduction order); the request's later draws must not shift with them."""
    from paged_runtime.sample import sampler
    monkeypatch.setattr(sampler, "_CANDIDATE_WIDTHS", widths)
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)) * 2
    after = []
    for top_k in (3, 40, 300):
        g = torch.Generator().manual_seed(11)
        meta = SamplingMetadata(torch.ones(1), False, [g], top_k=torch.tensor([top_k]))
        Sampler(torch.Generator().manual_seed(0))(logits.clone(), meta)
        after.append(torch.rand(1, generator=g).item())
    assert after[0] == after[1] == after[2]


# ---- allowed_token_ids and bad words (issue 17) --------------------------------------------------------------
def test_allowed_mask_limits_the_rows_that_have_one_and_logprobs_stay_raw():
    logits = torch.stack([LOGITS, LOGITS, LOGITS])
    blocked = torch.ones(2, LOGITS.numel(), dtype=torch.bool)
    blocked[0, [3, 4]] = False  # row 0 may only sample 3 or 4; row 2 may only sample 5
    blocked[1, 5] = False
    meta = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, generators=[None] * 3,
                            allowed=(torch.tensor([0, 2]), blocked), num_logprobs=1)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert out.token_ids.tolist() == [3, 0, 5]
    raw = LOGITS.log_softmax(-1)
    assert torch.allclose(out.logprobs, raw[[3, 0, 5]]) and out.ranks.tolist() == [4, 1, 6]
    sampled = Sampler(torch.Generator().manual_seed(0))(
        LOGITS.expand(400, -1).clone(), SamplingMetadata(
            temperature=torch.ones(400), all_greedy=False, generators=[None] * 400,
            allowed=(torch.arange(400), blocked[:1].expand(400, -1)))).token_ids
    assert set(sampled.tolist()) == {3, 4}


def test_bad_word_tokens_follow_the_output_not_the_prompt():
    from paged_runtime.sampling_params import SamplingParams
    from paged_runtime.worker.request_states import CachedRequest
    from paged_runtime.worker.sampling_metadata import _bad_word_tokens
    params = SamplingParams(bad_words=["x"])
    params.bad_words_token_ids = [[7], [1, 2, 3], [2, 9]]
    request = lambda tokens, num_prompt: CachedRequest("r", 0, tokens, num_prompt, params, frozenset(), None, None)
    assert _bad_word_tokens(request([1, 2], 2)) == [7]  # [1, 2] is the prompt's: only the one-token word
    assert _bad_word_tokens(request([5, 1, 2], 1)) == [7, 3, 9]  # output [1, 2]: 3 completes one, 9 another
    assert _bad_word_tokens(request([5, 1, 2, 4], 1)) == [7]
    assert _bad_word_tokens(request([5, 2], 1)) == [7, 9]
