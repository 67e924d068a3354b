"""Pooling requests in the scheduler, driven by hand: prefill only, no sampling, finished by the step that
computes the last prompt token; LAST pooling starts from prefix-cache hits, MEAN and CLS never do
(``pooling_params``); without chunked prefill (an encoder's engine) a prompt is admitted whole or waits."""
from __future__ import annotations

import pytest

from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.core.scheduler import Scheduler
from paged_runtime.pooling_params import RUNNERS, PoolingParams, parse_runner, resolve_runner
from paged_runtime.request import Request, RequestStatus
from paged_runtime.sampling_params import SamplingParams


def pooling_request(request_id: str, num_prompt: int, arrival: int, pooling_type: str = "LAST") -> Request:
    return Request(request_id, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=1), arrival,
                   max_tokens=1, pooling=PoolingParams(pooling_type))


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    assert not any(s.samples for s in out.scheduled if scheduler.requests[s.request_id].pooling is not None)
    appended = scheduler.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
    scheduler.check_invariants()
    return out, appended


def test_chunks_never_sample_and_the_last_one_finishes_the_request():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=4, max_num_batched_tokens=32)
    scheduler.add_request(pooling_request("p", 70, 0))
    request = scheduler.requests["p"]
    for expected in (32, 32, 6):
        out, _ = step(scheduler)
        assert [s.num_new_tokens for s in out.scheduled] == [expected]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.num_output_tokens == 0
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.num_free_blocks == 100


@pytest.mark.parametrize("pooling_type, num_hit", [("LAST", 64), ("MEAN", 0), ("CLS", 0)])
def test_last_pooling_starts_from_cached_blocks_mean_pooling_recomputes_them(pooling_type, num_hit):
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=4, max_num_batched_tokens=256)
    scheduler.add_request(pooling_request("first", 70, 0, pooling_type))
    step(scheduler)  # published: its four full blocks
    scheduler.add_request(pooling_request("again", 70, 1, pooling_type))
    out, _ = step(scheduler)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(num_hit, 70 - num_hit)]
    assert scheduler.kv_cache.num_hit_tokens == num_hit


def test_pooling_and_generation_share_a_step():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(Request("g", list(range(10, 20)), SamplingParams(max_tokens=3), 0, max_tokens=3))
    scheduler.add_request(pooling_request("p", 20, 1))
    out, _ = step(scheduler)
    assert {s.request_id: s.samples for s in out.scheduled} == {"g": True, "p": False}
    assert "p" not in scheduler.requests and scheduler.requests["g"].num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_whole_and_others_pass_it():
    scheduler = Scheduler(KVCacheManager(100, 16, enable_caching=False), max_num_seqs=4, max_num_batched_tokens=64,
                          chunked_prefill=False)
    for arrival, num_prompt in enumerate((40, 30, 20)):
        scheduler.add_request(pooling_request(f"p{arrival}", num_prompt, arrival, "CLS"))
    firsts = [[(s.request_id, s.start, s.num_new_tokens) for s in step(scheduler)[0].scheduled] for _ in range(2)]
    assert firsts == [[("p0", 0, 40), ("p2", 0, 20)], [("p1", 0, 30)]]
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache.num_free_blocks == 100


def test_runner_names():
    assert parse_runner("embed") == "pooling" and parse_runner("generate") == "generate"
    assert [resolve_runner(r, "BertModel", True) for r in ("auto", "pooling")] == ["pooling", "pooling"]
    assert [resolve_runner(r, "LlamaForCausalLM", False) for r in RUNNERS] == list(RUNNERS)
    with pytest.raises(ValueError, match="^BertModel is an encoder-only model"):
        resolve_runner("generate", "BertModel", True)
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        PoolingParams("MAX")  # sentence-transformers' max-over-tokens: not served
