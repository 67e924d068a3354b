"""Speculative decoding pieces on hand-built inputs: n-gram proposals, the rejection sampler, the config."""
from __future__ import annotations

import pytest
import torch

from paged_runtime.spec_decode.config import SpeculativeConfig
from paged_runtime.spec_decode.ngram import NgramProposer
from paged_runtime.spec_decode.rejection_sampler import RejectionSampler, SpecRow

CHI2_P001_DF = {2: 13.82, 3: 16.27, 4: 18.47}


# ---- n-gram -----------------------------------------------------------------------
def test_ngram_continues_the_most_recent_longest_match():
    proposer = NgramProposer(1, 3)
    # Tail [5, 6] occurred at 1..2 (followed by 7, 8, 9) and at 5..6 (followed by 1, 2): the later one wins.
    assert proposer.propose([4, 5, 6, 7, 8, 5, 6, 1, 2, 5, 6], 3) == [1, 2, 5]
    # The 3-gram [9, 5, 6] beats the 2-gram [5, 6]'s later occurrence.
    assert proposer.propose([9, 5, 6, 3, 3, 5, 6, 4, 9, 5, 6], 2) == [3, 3]


def test_ngram_respects_min_and_limit_and_the_sequence_end():
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 2], 3) == []  # only a 1-gram repeats
    assert NgramProposer(1, 4).propose([1, 2, 3, 4, 2], 3) == [3, 4, 2]
    assert NgramProposer(1, 4).propose([7, 7, 7], 5) == [7]  # overlapping match: only what follows exists
    assert NgramProposer(1, 4).propose([1, 2, 3], 3) == []
    assert NgramProposer(1, 2).propose([1, 2, 1], 0) == []


# ---- rejection sampler: greedy ----------------------------------------------------------
def one_hot_logits(ids: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(ids), vocab)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def greedy_row(drafts: list[int], first_row: int = 0) -> SpecRow:
    return SpecRow(first_row, drafts, None, 0.0, 0, 1.0, 0.0, None)


@pytest.mark.parametrize("drafts, target, emitted", [
    ([3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6]),  # all accepted + bonus
    ([3, 4, 5], [3, 1, 5, 6], [3, 1]),  # rejected at position 2: the target's token instead
    ([3, 4, 5], [2, 4, 5, 6], [2]),
    ([7], [7, 0], [7, 0]),
])
def test_greedy_verification_is_plain_greedy(drafts, target, emitted):
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    assert sampler(one_hot_logits(target), [greedy_row(drafts)]) == [emitted]


def test_rows_of_several_requests_are_verified_independently():
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    logits = one_hot_logits([1, 2, 3] + [4, 4])
    assert sampler(logits, [greedy_row([1, 9]), greedy_row([4], first_row=3)]) == [[1, 2], [4, 4]]


# ---- rejection sampler: random ----------------------------------------------------------
P = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
Q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])  # the draft even proposes a token the target never samples


def first_tokens(draft_probs: torch.Tensor | None, draws: int = 20_000) -> torch.Tensor:
    """First emitted token over many verifications of one draft drawn from ``draft_probs`` (or fixed at 2)."""
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    draft_gen = torch.Generator().manual_seed(1)
    logits = P.clamp(min=1e-30).log().expand(2, -1)
    out = []
    for _ in range(draws):
        if draft_probs is None:
            row = SpecRow(0, [2], None, 1.0, 0, 1.0, 0.0, None)
        else:
            draft = int(torch.multinomial(draft_probs, 1, generator=draft_gen))
            row = SpecRow(0, [draft], draft_probs.unsqueeze(0), 1.0, 0, 1.0, 0.0, None)
        out.append(sampler(logits, [row])[0][0])
    return torch.tensor(out)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert torch.all(support[samples]), "emitted a token the target never samples"
    counts = torch.bincount(samples, minlength=probs.numel()).double()[support]
    expected = probs[support].double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.slow
@pytest.mark.parametrize("draft_probs", [Q, None], ids=["draft-model", "ngram-one-hot"])
def test_emitted_tokens_follow_the_target_distribution(draft_probs):
    stat, df = chi_square(first_tokens(draft_probs), P)
    assert stat < CHI2_P001_DF[df], stat


def test_accepting_every_draft_would_be_caught():
    # With q != p, emitting the draft unconditionally gives q's distribution: the test has teeth.
    draft_gen = torch.Generator().manual_seed(1)
    samples = torch.multinomial(Q[:4] / Q[:4].sum(), 20_000, replacement=True, generator=draft_gen)
    stat, df = chi_square(samples, P)
    assert stat > CHI2_P001_DF[df]


def test_seeded_rows_draw_from_their_own_generator():
    logits = P.clamp(min=1e-30).log().expand(3, -1)
    row = lambda: SpecRow(0, [1, 3], Q.expand(2, -1), 1.0, 0, 1.0, 0.0, torch.Generator().manual_seed(9))
    alone = [RejectionSampler(torch.Generator().manual_seed(s))(logits, [row()]) for s in range(10)]
    assert len({tuple(a[0]) for a in alone}) == 1


# ---- config ------------------------------------------------------------------------------
def test_config_parses_vllm_spellings_and_names_bad_fields():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').prompt_lookup_max == 4
    assert SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 2}).method == "draft_model"
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "k": 1})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 2})


# ---- metrics -----------------------------------------------------------------------------
def test_spec_decode_counters_reach_prometheus():
    from prometheus_client import CollectorRegistry
    from paged_runtime.metrics import IterationStats, PrometheusStatLogger
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry)
    logger.record(IterationStats(0.0, 1, 0, 0.1, num_spec_drafts=2, num_spec_draft_tokens=6,
                                 num_spec_accepted_tokens=4, spec_accepted_per_position=[2, 1, 1]))
    logger.record(IterationStats(1.0, 1, 0, 0.1, num_spec_drafts=1, num_spec_draft_tokens=3,
                                 num_spec_accepted_tokens=1, spec_accepted_per_position=[1, 0, 0]))
    value = lambda name, **labels: registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value("vllm:spec_decode_num_drafts_total") == 3
    assert value("vllm:spec_decode_num_draft_tokens_total") == 9
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 5
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)] == [3, 1, 1]
    logger.close()
    assert value("vllm:spec_decode_num_drafts_total") is None
