"""Scheduling step N + 1 before step N's output is in (asynchronous scheduling), driven by hand."""
from __future__ import annotations

from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.core.scheduler import Scheduler
from paged_runtime.request import RequestStatus

from test_scheduler import make_request, plan


def tokens_for(out, token: int = 7) -> list[list[int]]:
    return [[token] if s.samples else [] for s in out.scheduled]


def test_a_decode_is_scheduled_again_with_its_pending_token_as_a_placeholder():
    scheduler = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=100)
    scheduler.add_request(make_request("a", 5, 0))
    a = scheduler.requests["a"]
    first = scheduler.schedule()
    assert a.num_computed_tokens == 5  # counted from the moment it is scheduled
    second = scheduler.schedule()  # step 1 still running
    [item] = second.scheduled
    assert (item.start, item.num_new_tokens, item.token_ids, item.samples) == (5, 1, [], True)
    assert a.num_computed_tokens == 6 and a.num_tokens == 5
    scheduler.update_from_output(first, [[7]])
    assert a.all_token_ids[5:] == [7] and a.num_computed_tokens == 6
    scheduler.update_from_output(second, [[8]])
    assert a.all_token_ids[5:] == [7, 8] and a.num_computed_tokens == 6
    scheduler.check_invariants()
    assert plan(scheduler.schedule()) == {"a": 1}


def test_a_pending_token_that_ends_the_request_is_not_scheduled_past():
    scheduler = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=100, max_model_len=8)
    scheduler.add_request(make_request("last", 5, 0, max_tokens=1))  # its first token is its last
    scheduler.add_request(make_request("long", 6, 1))  # its next token reaches max_model_len - 1 ... then 8
    first = scheduler.schedule()
    assert plan(scheduler.schedule()) == {"long": 1}
    scheduler.update_from_output(first, tokens_for(first))
    assert scheduler.requests.get("last") is None
    assert plan(scheduler.schedule()) == {}  # "long" now has 7 tokens; its pending 8th ends it
    scheduler.check_invariants()


def test_a_parent_forks_only_once_its_prompt_step_is_in():
    scheduler = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=100)
    scheduler.add_request(make_request("p", 9, 0, n=2, best_of=2, seed=1))
    first = scheduler.schedule()
    assert plan(first) == {"p": 8}  # all but the last prompt token: the fork point
    assert plan(scheduler.schedule()) == {}
    scheduler.update_from_output(first, tokens_for(first))
    assert sorted(plan(scheduler.schedule()).values()) == [1, 1]


def test_a_request_finished_or_preempted_while_its_step_ran():
    scheduler = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=100)
    scheduler.add_request(make_request("gone", 5, 0))
    scheduler.add_request(make_request("back", 5, 1))
    first = scheduler.schedule()
    scheduler.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    back = scheduler.requests["back"]
    scheduler._requeue(back)  # as a preemption by the next schedule would
    appended = scheduler.update_from_output(first, tokens_for(first))
    assert appended[0] == (None, [])
    assert appended[1] == (back, [7]) and back.status == RequestStatus.WAITING and back.num_computed_tokens == 0
    scheduler.check_invariants()


def test_blocks_are_published_only_up_to_the_steps_that_finished():
    kv = KVCacheManager(100, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 20, 0))
    first, second = scheduler.schedule(), scheduler.schedule()  # prompt chunks of 8 tokens
    scheduler.update_from_output(first, tokens_for(first))
    assert kv.num_hashed_blocks["a"] == 2  # the second chunk's blocks are not written yet
    scheduler.update_from_output(second, tokens_for(second))
    assert kv.num_hashed_blocks["a"] == 4


def test_unscheduling_a_step_that_never_ran_tells_the_runner_again():
    kv = KVCacheManager(100, 4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    scheduler.add_request(make_request("old", 5, 0))
    run = scheduler.schedule()
    scheduler.update_from_output(run, tokens_for(run))
    scheduler.add_request(make_request("new", 6, 1))
    scheduler.finish_requests(["old"], RequestStatus.FINISHED_ABORTED)
    lost = scheduler.schedule()
    assert lost.finished_req_ids == ["old"] and lost.scheduled[0].new_request is not None
    scheduler.unschedule(lost, resend=True)
    new = scheduler.requests["new"]
    assert new.num_computed_tokens == 4  # back to its prefix-cache hit (old's first block)
    again = scheduler.schedule()
    assert again.finished_req_ids == ["old"]
    [item] = again.scheduled
    assert item.new_request is not None and item.block_ids_update == (0, kv.block_ids("new"))
    assert (item.start, item.num_new_tokens) == (4, 2)
