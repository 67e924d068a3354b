"""The sampler splits rows on the host (``HostRows``): the same tokens as before, and no device read
except the one for top-p / min_p rows (counted here on the CPU by patching the tensor's read methods;
tests/kernels/test_one_sync_per_step.py checks the real syncs on CUDA)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from paged_runtime.sample import sampler
from paged_runtime.sample.sampler import HostRows, Penalties, Sampler, SamplingMetadata

READS = ("tolist", "item", "nonzero", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def device_reads(monkeypatch):
    """Every read of a tensor's values on the host, by the sampler function that made it. A seeded row's draw
    from its own (host) generator in ``Sampler._seed`` is not a device read and is not counted."""
    reads = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_name
            if caller != "_seed":
                reads.append((_name, caller))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    return reads


def batch():
    """Greedy, temperature, seeded, top-k, top-k + top-p, top-p rows side by side (V = 300)."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(4)) * 3
    temperature = torch.tensor([0.0, 0.8, 1.0, 1.0, 0.7, 0.0, 1.2, 1.0])
    top_k = torch.tensor([300, 300, 5, 40, 300, 3, 100, 2])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.95, 1.0, 1.0, 0.5])
    seeds = [None, None, 11, None, 12, 13, None, 14]
    return logits, temperature, top_k, top_p, seeds


def host_rows(meta: SamplingMetadata) -> HostRows:
    copy = lambda t: t.numpy().copy() if t is not None else None
    return HostRows(copy(meta.temperature), copy(meta.top_k), copy(meta.top_p), copy(meta.min_p))


# Three steps of ``batch()`` from the sampler as it was before the host split (PR state of main, 848bede).
BEFORE = {
    (64, 1024, 8192): [[98, 8, 113, 4, 84, 221, 151, 117], [98, 253, 273, 14, 84, 221, 205, 117],
                       [98, 297, 278, 105, 84, 221, 140, 117]],
    (4, 64): [[98, 70, 113, 76, 84, 221, 151, 117], [98, 297, 273, 33, 84, 221, 224, 117],
              [98, 297, 278, 76, 84, 221, 151, 117]],
    (): [[98, 128, 113, 4, 84, 221, 140, 117], [98, 297, 273, 150, 84, 221, 136, 117],
         [98, 253, 278, 14, 84, 221, 209, 117]],
}


@pytest.mark.parametrize("widths", list(BEFORE), ids=["ladder", "narrow", "sorted"])
@pytest.mark.parametrize("with_host", [True, False], ids=["host-rows", "read-from-tensors"])
def test_mixed_batches_sample_the_same_tokens_as_before(widths, with_host, monkeypatch):
    monkeypatch.setattr(sampler, "_CANDIDATE_WIDTHS", widths)
    logits, temperature, top_k, top_p, seeds = batch()
    generators = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    sample = Sampler(torch.Generator().manual_seed(0))
    steps = []
    for _ in range(3):
        meta = SamplingMetadata(temperature, False, generators, top_k=top_k, top_p=top_p)
        meta.host = host_rows(meta) if with_host else None
        steps.append(sample(logits.clone(), meta).token_ids.tolist())
    assert steps == BEFORE[widths]


def test_rows_are_told_apart_on_the_host():
    rows = HostRows(np.array([0, 1, 1, 1, 1], np.float32), top_k=np.array([300, 300, 5, 100, 0]),
                    top_p=np.array([1, 1, 1, 0.9, 1], np.float32), min_p=np.array([0, 0.1, 0, 0, 0], np.float32))
    assert rows.data_dependent().tolist() == [False, True, False, True, False]
    assert rows.filtered(300).tolist() == [False, True, True, True, True]
    assert rows.top_k_fits(64, 300).tolist() == [False, False, True, False, True]  # top_k 0 counts as 1
    assert rows.top_k_fits(1024, 300).tolist() == [False, False, True, True, True]
    assert rows.take(np.array([3, 1])).top_k.tolist() == [100, 300]


def common_meta(n: int, **filters) -> SamplingMetadata:
    """Greedy, plain, seeded and top-k rows with penalties, a logit bias, an allowed list and logprobs."""
    vocab = 50
    temperature = torch.tensor([0.0, 0.9, 1.0, 1.1] * (n // 4))
    meta = SamplingMetadata(temperature, False, [None, None, torch.Generator().manual_seed(3), None] * (n // 4),
                            top_k=torch.tensor([vocab, vocab, 7, 3] * (n // 4)), **filters)
    blocked = torch.ones(1, vocab, dtype=torch.bool)
    blocked[0, :10] = False
    meta.allowed = (torch.tensor([1]), blocked)
    meta.logit_bias = (torch.tensor([0, 2]), torch.tensor([4, 5]), torch.tensor([2.0, float("-inf")]))
    meta.penalties = Penalties(torch.tensor([0, 3]), torch.tensor([1, 1]), torch.tensor([2.0, 0.0]),
                               torch.tensor([1.2, 1.2]), torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]))
    meta.num_logprobs, meta.logprob_rows = 2, torch.tensor([0, 3])
    meta.host = host_rows(meta)
    return meta


def test_common_cases_read_nothing_from_the_device(device_reads):
    logits, meta = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)), common_meta(8)
    device_reads.clear()  # building the test's metadata is not the sampler's
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert device_reads == []
    assert out.token_ids.shape == (8,) and out.top_ids.shape == (8, 2)


def test_top_p_rows_cost_one_read_whatever_rungs_they_try(device_reads, monkeypatch):
    monkeypatch.setattr(sampler, "_CANDIDATE_WIDTHS", (2, 4, 8))  # flat rows miss every rung
    logits, meta = torch.zeros(8, 50), common_meta(8, top_p=torch.full((8,), 0.9))
    device_reads.clear()
    Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert device_reads == [("tolist", "_sample_filtered")]


def test_a_top_p_row_that_misses_a_rung_takes_its_first_fit(monkeypatch):
    """After the one read, a missed row races in every later rung; the first it fits wins: its tokens stay
    in the full-vocabulary filter's support, and a seeded row's tokens equal the full-sort path's."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(5)) * 0.3  # nucleus of ~250 tokens
    keep = torch.isfinite(sampler.apply_top_k_top_p(logits, None, torch.tensor([0.95])))[0]
    draws = {}
    for widths in [(2, 8, 64), ()]:
        monkeypatch.setattr(sampler, "_CANDIDATE_WIDTHS", widths)
        g = torch.Generator().manual_seed(21)
        sample = Sampler(torch.Generator().manual_seed(0))
        draws[widths] = [int(sample(logits.clone(), SamplingMetadata(torch.ones(1), False, [g],
                                                                      top_p=torch.tensor([0.95]))).token_ids)
                         for _ in range(30)]
    assert draws[(2, 8, 64)] == draws[()]
    assert all(keep[t] for t in draws[()])


def test_logit_bias_names_each_token_once_and_a_mask_wins():
    """A bad word's token also biased (or named by two words) is one -inf entry: no accumulating index_put."""
    from paged_runtime.sampling_params import SamplingParams
    from paged_runtime.worker.request_states import CachedRequest
    from paged_runtime.worker.sampling_metadata import _logit_bias
    params = SamplingParams(logit_bias={7: 2.0, 3: -1.5}, min_tokens=5)
    params.bad_words_token_ids = [[7], [1, 7], [9]]
    request = CachedRequest("r", 0, [5, 1], 1, params, frozenset({2, 9}), None, None)
    rows, cols, values = _logit_bias([request])
    assert sorted(zip(cols.tolist(), values.tolist())) == [(2, float("-inf")), (3, -1.5), (7, float("-inf")),
                                                           (9, float("-inf"))]
    assert rows.tolist() == [0] * 4
