"""The unified token-budget scheduler, driven by hand without a model."""
from __future__ import annotations

from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.core.scheduler import Scheduler
from paged_runtime.request import Request, RequestStatus
from paged_runtime.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt: int, arrival: int, max_tokens: int = 100, **params) -> Request:
    return Request(request_id, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=max_tokens, **params),
                   arrival, max_tokens=max_tokens, eos_token_ids=frozenset({2}))


def plan(out) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


def run_step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    scheduler.update_from_output(out, [[token] if s.samples else [] for s in out.scheduled])
    scheduler.check_invariants()
    return out


def test_chunked_prefill_mixes_with_decodes_under_one_budget():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=8, max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", 10, 0))
    scheduler.add_request(make_request("b", 50, 1))
    assert plan(run_step(scheduler)) == {"a": 10, "b": 22}  # a whole, b's first chunk
    assert plan(run_step(scheduler)) == {"a": 1, "b": 28}  # a decodes while b finishes its prompt
    out = run_step(scheduler)
    assert plan(out) == {"a": 1, "b": 1}
    a = scheduler.requests["a"]
    assert a.num_output_tokens == 3 and a.num_computed_tokens == 12


def test_max_num_seqs_caps_admission():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=2, max_num_batched_tokens=1000)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 5, i))
    assert plan(run_step(scheduler)) == {"r0": 5, "r1": 5}
    assert scheduler.num_waiting == 1


def test_finished_request_slot_is_reused_in_the_next_step():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=1, max_num_batched_tokens=1000)
    scheduler.add_request(make_request("short", 5, 0, max_tokens=1))
    scheduler.add_request(make_request("next", 5, 1))
    short = scheduler.requests["short"]
    assert plan(run_step(scheduler)) == {"short": 5}
    assert plan(run_step(scheduler)) == {"next": 5}
    assert short.status == RequestStatus.FINISHED_LENGTH


def test_preemption_frees_the_latest_arrival_and_admits_nothing():
    # 4 blocks of 4 slots: two requests of 7 tokens take 2 blocks each.
    scheduler = Scheduler(KVCacheManager(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    scheduler.add_request(make_request("old", 7, 0))
    scheduler.add_request(make_request("new", 7, 1))
    run_step(scheduler)  # both prefilled: 7 tokens computed, 8 tokens each
    run_step(scheduler)  # slot 7 still fits in their two blocks
    assert scheduler.kv_cache.num_free_blocks == 0
    scheduler.add_request(make_request("later", 2, 2))
    out = run_step(scheduler)  # each needs slot 8 -> a third block; only "old" can get it
    assert out.num_preempted == 1 and plan(out) == {"old": 1}
    new = scheduler.requests["new"]
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0 and new.num_output_tokens == 2
    assert scheduler.waiting[0] is new  # back ahead of later arrivals
    assert scheduler.kv_cache.block_ids("new") == []


def test_stop_conditions():
    scheduler = Scheduler(KVCacheManager(20, 16), max_num_seqs=4, max_num_batched_tokens=100)
    scheduler.add_request(make_request("eos", 3, 0))
    scheduler.add_request(make_request("ignore", 3, 1, ignore_eos=True))
    scheduler.add_request(make_request("stop_id", 3, 2, stop_token_ids=[2, 9]))
    out = scheduler.schedule()
    requests = [request for request, _ in scheduler.update_from_output(out, [[2], [2], [9]])]
    assert [r.status for r in requests] == [
        RequestStatus.FINISHED_STOPPED, RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED]
    assert requests[2].stop_reason == 9
    assert scheduler.schedule().finished_req_ids == ["eos", "stop_id"]


def test_abort_frees_blocks_wherever_the_request_is():
    kv = KVCacheManager(10, 16)
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100)
    scheduler.add_request(make_request("running", 20, 0))
    scheduler.add_request(make_request("waiting", 20, 1))
    run_step(scheduler)
    assert kv.num_free_blocks == 8
    scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 10 and not scheduler.has_unfinished_requests()
    scheduler.check_invariants()


def run_until_idle(scheduler: Scheduler, max_steps: int = 200) -> list:
    """Steps until nothing is left (a stall fails the test instead of hanging it); every step's output."""
    outs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outs
        outs.append(run_step(scheduler))
    raise AssertionError(f"still unfinished after {max_steps} steps: {sorted(scheduler.requests)}")


def test_nothing_is_scheduled_past_max_model_len():
    # min_tokens beyond the context (as if the processor had let it through) must not push past the limit.
    scheduler = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=100, max_model_len=12)
    request = make_request("long", 5, 0, max_tokens=100, min_tokens=50)
    scheduler.add_request(request)
    outs = run_until_idle(scheduler)
    assert all(s.start + s.num_scheduled <= 12 for out in outs for s in out.scheduled)
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_tokens == 12


def test_a_request_larger_than_the_cache_fails_at_admission_and_the_rest_are_served():
    kv = KVCacheManager(4, 4)  # 16 slots in all
    for budget in (100, 8):  # whole prompt at once, or chunked (it would preempt itself once past 16)
        scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget)
        huge, small = make_request("huge", 20, 0), make_request("small", 3, 1, max_tokens=2)
        scheduler.add_request(huge)
        scheduler.add_request(small)
        out = run_step(scheduler)
        assert plan(out) == {"small": 3}
        assert huge.status == RequestStatus.FINISHED_ERROR and "KV cache" in huge.error
        assert scheduler.take_failed() == [huge] and scheduler.take_failed() == []
        run_until_idle(scheduler)
        assert small.status == RequestStatus.FINISHED_LENGTH and kv.num_free_blocks == 4


def test_a_running_request_that_outgrows_the_cache_fails_and_frees_its_blocks():
    kv = KVCacheManager(4, 4)
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100)
    grower, after = make_request("grower", 10, 0, max_tokens=100), make_request("after", 3, 1, max_tokens=2)
    scheduler.add_request(grower)
    scheduler.add_request(after)
    outs = run_until_idle(scheduler)
    assert grower.status == RequestStatus.FINISHED_ERROR and grower.num_tokens == 17  # slot 16 never existed
    assert scheduler.take_failed() == [grower]
    assert after.status == RequestStatus.FINISHED_LENGTH and kv.num_free_blocks == 4
    assert sum(out.num_preempted for out in outs) == 0  # it never preempted itself


def test_a_group_above_a_lowered_max_num_seqs_runs_alone_instead_of_stalling():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=4, max_num_batched_tokens=1000)
    group = make_request("group", 5, 0, max_tokens=3, n=3, temperature=0)
    scheduler.add_request(group)
    scheduler.add_request(make_request("after", 5, 1, max_tokens=2))
    scheduler.max_num_seqs = 2  # lowered live (Ray Serve reconfigure) while the group waits
    first = run_step(scheduler)
    assert plan(first) == {"group": 4}  # admitted alone (nothing else runs), all but its last token
    outs = run_until_idle(scheduler)
    assert {"group\x1f1", "group\x1f2"} <= {s.request_id for out in outs for s in out.scheduled}
    assert not any("after" in plan(out) and len(plan(out)) > 1 for out in outs)  # never beside the group


def test_pending_forks_hold_their_seats_against_later_arrivals():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=3, max_num_batched_tokens=20)
    scheduler.add_request(make_request("group", 40, 0, max_tokens=2, n=3, temperature=0))
    scheduler.add_request(make_request("b", 3, 1, max_tokens=2))
    assert plan(run_step(scheduler)) == {"group": 20}
    assert plan(run_step(scheduler)) == {"group": 19}  # b would take a seat the group's forks need
    run_until_idle(scheduler)  # check_invariants: never more than max_num_seqs running


def test_the_default_step_budget_is_vllms_cpu_server_budget_on_the_cpu_and_up_to_8192_tokens_on_a_gpu():
    # On 2 CPU cores a step of 8,192 prompt tokens takes seconds, and every running stream waits for it.
    import torch

    from paged_runtime.config import EngineConfig
    from paged_runtime.engine.core import _step_budget
    from paged_runtime.models import registry

    llama, cpu, gpu = registry.family("LlamaForCausalLM"), torch.device("cpu"), torch.device("cuda")
    unset, asked = EngineConfig(model="m"), EngineConfig(model="m", max_num_batched_tokens=512)
    assert [_step_budget(unset, n, llama, cpu) for n in (1024, 8192, 32768)] == [2048, 2048, 2048]
    assert [_step_budget(unset, n, llama, gpu) for n in (1024, 8192, 32768)] == [2048, 8192, 8192]
    assert _step_budget(asked, 8192, llama, cpu) == _step_budget(asked, 8192, llama, gpu) == 512
    bert = registry.family("BertModel")  # an encoder computes each prompt in one step
    assert _step_budget(unset, 4096, bert, cpu) == _step_budget(unset, 4096, bert, gpu) == 4096


def test_long_prefill_token_threshold_caps_each_requests_chunk_unless_it_is_alone():
    # vLLM's long_prefill_token_threshold: a long prompt's chunks stop taking the whole step from the streams
    # that decode beside it; a request alone in the scheduler still gets the whole budget.
    scheduler = Scheduler(KVCacheManager(100, 16, enable_caching=False), max_num_seqs=8,  # the prompts are alike
                          max_num_batched_tokens=1000, long_prefill_token_threshold=24)
    scheduler.add_request(make_request("alone", 60, 0))
    assert plan(run_step(scheduler)) == {"alone": 60}
    scheduler.add_request(make_request("long", 60, 1))
    scheduler.add_request(make_request("short", 10, 2))
    assert plan(run_step(scheduler)) == {"alone": 1, "long": 24, "short": 10}
    assert plan(run_step(scheduler)) == {"alone": 1, "long": 24, "short": 1}
    assert plan(run_step(scheduler)) == {"alone": 1, "long": 12, "short": 1}
    assert plan(run_step(scheduler)) == {"alone": 1, "long": 1, "short": 1}


def test_no_threshold_without_chunked_prefill():
    scheduler = Scheduler(KVCacheManager(100, 16), max_num_seqs=8, max_num_batched_tokens=1000,
                          chunked_prefill=False, long_prefill_token_threshold=24)
    scheduler.add_request(make_request("a", 60, 0))
    scheduler.add_request(make_request("b", 40, 1))
    assert plan(run_step(scheduler)) == {"a": 60, "b": 40}  # an encoder's prompt is computed whole
