"""Prefix caching, copy-on-write fork and priority scheduling, with exact block accounting."""
from __future__ import annotations

from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.core.scheduler import Scheduler
from paged_runtime.request import Request
from paged_runtime.sampling_params import SamplingParams

BS = 16


def make_request(request_id: str, token_ids: list[int], arrival: int, priority: int = 0,
                 salt: str | None = None, max_tokens: int = 50) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens), arrival, max_tokens,
                   frozenset({2}), priority=priority, cache_salt=salt)


def step(scheduler: Scheduler, token: int = 7) -> dict[str, int]:
    out = scheduler.schedule()
    scheduler.update_from_output(out, [[token] if s.samples else [] for s in out.scheduled])
    scheduler.check_invariants()
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


PREFIX = list(range(100, 164))  # 64 tokens = 4 full blocks


def test_shared_prefix_is_stored_once():
    kv = KVCacheManager(50, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1000)
    scheduler.add_request(make_request("a", PREFIX + [1, 2, 3], 0))
    assert step(scheduler) == {"a": 67}
    scheduler.add_request(make_request("b", PREFIX + [4, 5], 1))
    assert step(scheduler) == {"a": 1, "b": 2}  # b computes only its suffix
    a, b = kv.block_ids("a"), kv.block_ids("b")
    assert a[:4] == b[:4] and a[4] != b[4]
    assert [kv.pool.blocks[i].ref_count for i in a[:4]] == [2, 2, 2, 2]
    assert kv.num_free_blocks == 50 - 6
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (67 + 66, 64)
    assert scheduler.requests["b"].num_cached_tokens == 64


def test_long_shared_prefix_computes_only_the_suffix():
    kv = KVCacheManager(200, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256)
    prefix = list(range(1000, 2000))
    scheduler.add_request(make_request("first", prefix + [5], 0, max_tokens=1))
    computed = 0
    while scheduler.has_unfinished_requests():
        computed += sum(step(scheduler).values())
    assert computed == 1001
    scheduler.add_request(make_request("second", prefix + [6, 7, 8], 1, max_tokens=1))
    assert step(scheduler) == {"second": 1003 - 992}  # 62 cached blocks = 992 tokens
    assert kv.num_free_blocks == 200


def test_a_full_prompt_hit_still_computes_the_last_token():
    kv = KVCacheManager(20, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1000)
    scheduler.add_request(make_request("a", PREFIX, 0, max_tokens=1))
    step(scheduler)
    scheduler.add_request(make_request("b", PREFIX, 1, max_tokens=1))
    assert step(scheduler) == {"b": 16}  # 3 blocks hit, the 4th (holding the last token) recomputed


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(20, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1000)
    scheduler.add_request(make_request("a", PREFIX + [1], 0, salt="tenant-1", max_tokens=1))
    step(scheduler)
    scheduler.add_request(make_request("b", PREFIX + [1], 1, salt="tenant-2", max_tokens=1))
    scheduler.add_request(make_request("c", PREFIX + [1], 2, salt="tenant-1", max_tokens=1))
    assert step(scheduler) == {"b": 65, "c": 1}


def test_freed_blocks_stay_cached_until_reused_lru():
    kv = KVCacheManager(6, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1000)
    scheduler.add_request(make_request("a", PREFIX + [1], 0, max_tokens=1))
    step(scheduler)
    assert kv.num_free_blocks == 6 and len(kv.pool.cached) == 4  # free, but still findable
    scheduler.add_request(make_request("x", list(range(5000, 5040)), 1, max_tokens=1))
    # x takes 3 blocks from the queue's head: the never-used one, then a's tail (partial, then last full).
    step(scheduler)
    assert len(kv.pool.cached) == 3 + 2  # a's first three blocks survive, plus x's two full ones
    scheduler.add_request(make_request("b", PREFIX + [1], 2, max_tokens=1))
    assert step(scheduler) == {"b": 65 - 48}


def test_fork_shares_the_partial_tail_and_copies_it_once_on_write():
    kv = KVCacheManager(10, BS)
    parent = make_request("p", list(range(40)), 0)
    child = make_request("c", list(range(40)), 1)
    assert kv.allocate_slots(parent, 40)
    parent.num_computed_tokens = child.num_computed_tokens = 40
    kv.fork(parent, child)
    assert kv.block_ids("c") == kv.block_ids("p") == [0, 1, 2] and kv.num_free_blocks == 7
    assert kv.allocate_slots(child, 1)  # writes slot 40, inside the shared tail block
    assert kv.take_pending_copies() == [(2, 3)]
    assert kv.block_ids("c") == [0, 1, 3] and kv.pool.blocks[2].ref_count == 1
    assert kv.allocate_slots(parent, 1)  # the tail is private again: no copy
    assert kv.take_pending_copies() == [] and kv.block_ids("p") == [0, 1, 2]
    kv.check_invariants([parent, child])


def test_priority_arrival_jumps_the_queue_and_preempts_a_lower_priority_runner():
    kv = KVCacheManager(4, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=1000, policy="priority")
    scheduler.add_request(make_request("low", list(range(40)), 0, priority=5))
    step(scheduler)  # 3 blocks
    scheduler.add_request(make_request("queued", list(range(300, 310)), 1, priority=5))
    scheduler.add_request(make_request("urgent", list(range(200, 230)), 2, priority=0))
    # "urgent" (2 blocks) comes before "queued" and only fits once "low" is preempted;
    # "low" then waits ahead of "queued" (same priority, earlier arrival).
    assert step(scheduler) == {"urgent": 30}
    low = scheduler.requests["low"]
    assert low.num_preemptions == 1 and [r.request_id for r in scheduler.waiting] == ["low", "queued"]


def test_fcfs_ignores_priority():
    scheduler = Scheduler(KVCacheManager(10, BS), max_num_seqs=1, max_num_batched_tokens=1000)
    scheduler.add_request(make_request("first", [5] * 3, 0, priority=9))
    scheduler.add_request(make_request("second", [6] * 3, 1, priority=0))
    assert step(scheduler) == {"first": 3}


def test_resumed_request_is_not_chosen_again_during_its_prefill():
    kv = KVCacheManager(5, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=39)
    scheduler.add_request(make_request("old", list(range(32)), 0))
    resumed = make_request("resumed", list(range(500, 540)), 1)
    resumed.num_preemptions = 1  # it was preempted before and is now resuming
    scheduler.add_request(resumed)
    assert step(scheduler) == {"old": 32, "resumed": 7}  # old: 2 blocks, resumed: 1 block, mid-prefill
    assert kv.num_free_blocks == 2
    scheduler.max_num_batched_tokens = 40
    # old needs a 3rd block for slot 32, resumed needs 2 more for its 33 remaining tokens (4 > 2 free).
    # Resumed is the later arrival, but it is mid-prefill after a preemption: old yields instead.
    assert step(scheduler) == {"resumed": 33}
    assert scheduler.requests["old"].num_preemptions == 1 and resumed.num_preemptions == 1
