"""KV-cache manager contract: opaque cache hits, block-id table updates for the runner, invariants."""
from __future__ import annotations

import pytest

from paged_runtime.core.block_pool import BlockPool
from paged_runtime.core.kv_cache_manager import HOLE_BLOCK_ID, NO_COMPUTED_BLOCKS, KVCacheManager
from paged_runtime.core.scheduler import Scheduler
from paged_runtime.request import Request, RequestStatus
from paged_runtime.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, token_ids: list[int], arrival: int = 0, **params) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(**params), arrival, max_tokens=100,
                   eos_token_ids=frozenset({2}))


def computed_request(kv: KVCacheManager, request: Request) -> Request:
    """Allocate and 'compute' the whole prompt of ``request``, publishing its full blocks."""
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return request


# ---- take_block_ids_update --------------------------------------------------------------
def test_new_table_then_appends():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(10))
    assert kv.take_block_ids_update("a") is None  # no table yet
    assert kv.allocate_slots(a, 10)
    assert kv.take_block_ids_update("a") == (0, [0, 1, 2])
    assert kv.take_block_ids_update("a") is None  # nothing changed since the last take
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2)  # slots 10, 11 fit in block 2
    assert kv.take_block_ids_update("a") is None
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1)
    a.num_computed_tokens = 13
    assert kv.allocate_slots(a, 4)  # two appends between takes come as one
    assert kv.take_block_ids_update("a") == (3, [3, 4])
    assert kv.block_ids("a") == [0, 1, 2, 3, 4]
    kv.check_invariants([a])


def test_an_empty_new_table_is_still_an_update():
    kv = KVCacheManager(4, BS)
    a = make_request("a", range(5))
    assert kv.allocate_slots(a, 0)
    assert kv.take_block_ids_update("a") == (0, [])


def test_new_table_from_prefix_hits():
    kv = KVCacheManager(10, BS)
    a = computed_request(kv, make_request("a", range(12)))
    kv.take_block_ids_update("a")
    b = make_request("b", list(range(12)) + [99], arrival=1)
    computed, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 12  # 3 full blocks hit; the 13th token is computed
    assert kv.allocate_slots(b, 1, computed)
    assert kv.take_block_ids_update("b") == (0, [0, 1, 2, 3])
    assert [kv.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 2, 1]
    assert kv.take_block_ids_update("a") is None  # sharing a's blocks does not change a's table
    b.num_computed_tokens = 12
    kv.check_invariants([a, b])


def test_copy_on_write_replaces_the_tail_entry():
    kv = KVCacheManager(10, BS)
    parent = make_request("p", range(10))
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    children = [parent.fork(i) for i in (1, 2)]
    for child in children:
        kv.fork(parent, child)
    assert kv.take_block_ids_update("p") == (0, [0, 1, 2])
    for child in children:
        assert kv.take_block_ids_update(child.request_id) == (0, [0, 1, 2])  # a fork is a new table
    one, two = children
    assert kv.allocate_slots(one, 1)  # slot 10 is in the shared tail: private copy
    assert kv.take_pending_copies() == [(2, 3)]
    assert kv.take_block_ids_update(one.request_id) == (2, [3])
    assert kv.allocate_slots(two, 3)  # slots 10..12: copy of the tail, then one new block
    assert kv.take_pending_copies() == [(2, 5)]
    assert kv.take_block_ids_update(two.request_id) == (2, [5, 4])
    assert kv.allocate_slots(parent, 1)  # block 2 is the parent's alone now: no copy, no change
    assert kv.take_pending_copies() == [] and kv.take_block_ids_update("p") is None
    kv.check_invariants([parent, one, two])


def test_free_drops_the_table_and_readmission_starts_over():
    kv = KVCacheManager(6, BS)
    a = make_request("a", range(6))
    assert kv.allocate_slots(a, 6)
    assert kv.take_block_ids_update("a") == (0, [0, 1])
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 3)  # block 2 appended, never taken
    kv.free(a)
    a.num_computed_tokens = 0
    assert kv.take_block_ids_update("a") is None and kv.block_ids("a") == []
    assert kv.allocate_slots(a, 9)  # free queue after the tail-first free: [3, 4, 5, 2, 1, 0]
    assert kv.take_block_ids_update("a") == (0, [3, 4, 5])
    kv.check_invariants([a])


def test_preempted_request_gets_its_whole_new_table_after_readmission():
    """What the scheduler sends the runner: each table change once, the whole new table after a preemption,
    and a request's full data only the first time it is scheduled."""
    # test_scheduler's preemption scenario: two identical 7-token prompts in 4 blocks of 4 slots.
    kv = KVCacheManager(4, BS)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    old, new = make_request("old", range(10, 17)), make_request("new", range(10, 17), arrival=1)
    scheduler.add_request(old)
    scheduler.add_request(new)
    sent = [step(scheduler) for _ in range(2)]
    assert updates(sent) == {"old": [(0, [0, 1])], "new": [(0, [2, 3])]}
    assert [s.request_id for out in sent for s in out.scheduled if s.new_request] == ["old", "new"]
    out = step(scheduler)  # slot 8 needs a third block: "new" is preempted, "old" gets its block 3
    assert out.num_preempted == 1 and updates([out]) == {"old": [(2, [3])]}
    scheduler.finish_requests(["old"], RequestStatus.FINISHED_ABORTED)
    # old's full blocks 0 and 1 hold exactly new's first 8 tokens (same prompt, same sampled 7s).
    out = step(scheduler)
    assert out.scheduled[0].num_new_tokens == 1 and new.num_computed_tokens == 9
    assert updates([out]) == {"new": [(0, [0, 1, 2])]} and out.scheduled[0].new_request is None  # runner kept it


def updates(outputs) -> dict[str, list[tuple[int, list[int]]]]:
    sent = {}
    for out in outputs:
        for s in out.scheduled:
            if s.block_ids_update is not None:
                sent.setdefault(s.request_id, []).append(s.block_ids_update)
    return sent


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    scheduler.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
    scheduler.check_invariants()
    return out


# ---- prefix-cache lookups ---------------------------------------------------------------
def test_prompt_logprobs_skip_the_prefix_cache_and_forks_inherit_it():
    kv = KVCacheManager(10, BS)
    computed_request(kv, make_request("a", range(12)))
    plain = make_request("plain", range(13))
    logprobs = make_request("logprobs", range(13), prompt_logprobs=0)
    flagged = Request("flagged", list(range(13)), SamplingParams(), 0, 100, skip_prefix_cache=True)
    assert not plain.skip_prefix_cache and logprobs.skip_prefix_cache and flagged.skip_prefix_cache
    assert logprobs.fork(1).skip_prefix_cache and flagged.fork(1).skip_prefix_cache
    assert kv.get_computed_blocks(plain)[1] == 12
    assert kv.get_computed_blocks(logprobs) == (NO_COMPUTED_BLOCKS, 0)
    assert kv.get_computed_blocks(flagged) == (NO_COMPUTED_BLOCKS, 0)


def test_record_prefix_query_counts_tokens():
    kv = KVCacheManager(10, BS)
    kv.record_prefix_query(make_request("a", range(13)), 12)
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (13, 12)
    off = KVCacheManager(10, BS, enable_caching=False)
    off.record_prefix_query(make_request("a", range(13)), 0)
    assert (off.num_queried_tokens, off.num_hit_tokens) == (0, 0)


def test_stale_hits_are_refused():
    kv = KVCacheManager(4, BS)
    a = computed_request(kv, make_request("a", range(8)))
    kv.free(a)  # blocks 0 and 1 stay cached in the free queue: [2, 3, 1, 0]
    b = make_request("b", list(range(8)) + [5], arrival=1)
    computed, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 8
    x = make_request("x", range(100, 112))
    assert kv.allocate_slots(x, 12) and kv.block_ids("x") == [2, 3, 1]  # block 1's hash is evicted
    kv.free(x)
    with pytest.raises(AssertionError, match="stale cache hit"):
        kv.allocate_slots(b, 1, computed)


def test_hits_are_only_for_a_request_without_a_table():
    kv = KVCacheManager(10, BS)
    computed_request(kv, make_request("a", range(8)))
    b = make_request("b", list(range(8)) + [5], arrival=1)
    computed, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 9)
    with pytest.raises(AssertionError, match="already has a table"):
        kv.allocate_slots(b, 0, computed)


# ---- hashing invariants ------------------------------------------------------------------
def test_a_hashed_block_is_not_hashed_again_until_evicted_or_reset():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, b"h1")
    with pytest.raises(AssertionError, match="already cached"):
        pool.cache(block, b"h1")
    pool.free([block])
    pool.allocate(2)  # the free queue is [1, 0]: block 0 is handed out again and its hash evicted
    assert block.block_hash is None and not pool.cached
    pool.cache(block, b"h2")
    pool.reset_cache()
    pool.cache(block, b"h3")
    assert pool.cached == {b"h3": block}


def test_a_free_block_is_never_hashed():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="is free"):
        pool.cache(block, b"h")


def test_the_first_holder_of_a_hash_wins():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, b"h")
    pool.cache(second, b"h")
    assert pool.cached == {b"h": first} and second.block_hash is None


def test_a_free_block_without_a_hash_cannot_be_touched():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="uncached"):
        pool.touch([block])


def test_reset_prefix_cache_never_rehashes_blocks_in_tables():
    kv = KVCacheManager(10, BS)
    a = make_request("a", range(13))  # computed in chunks of 6, 3 and 4 tokens
    assert kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.cache_computed_blocks(a)
    assert kv.pool.blocks[0].block_hash is not None
    kv.reset_prefix_cache()
    assert kv.allocate_slots(a, 3)
    a.num_computed_tokens = 9  # blocks 0 and 1 full now, but both were in the table at the reset
    kv.cache_computed_blocks(a)
    assert not kv.pool.cached
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 13  # block 2 (allocated after the reset) fills up and is hashed
    kv.cache_computed_blocks(a)
    assert list(kv.pool.cached.values()) == [kv.pool.blocks[2]]
    kv.check_invariants([a])


def test_a_freed_cached_block_is_rehashed_after_reuse():
    kv = KVCacheManager(2, BS)
    a = computed_request(kv, make_request("a", range(8)))
    kv.free(a)
    b = computed_request(kv, make_request("b", range(100, 108), arrival=1))  # evicts and reuses both
    assert kv.block_ids("b") == [1, 0]
    assert {block.block_id for block in kv.pool.cached.values()} == {0, 1}
    assert kv.get_computed_blocks(make_request("c", range(9)))[1] == 0  # a's prefix is gone
    kv.check_invariants([b])


def test_check_invariants_catches_a_hash_past_the_hashed_count():
    kv = KVCacheManager(4, BS)
    a = make_request("a", range(8))
    assert kv.allocate_slots(a, 8)
    kv.pool.cache(kv.pool.blocks[1], b"behind the manager's back")
    with pytest.raises(AssertionError, match="hash past its hashed count"):
        kv.check_invariants([a])


def test_a_shared_block_is_never_written():
    kv = KVCacheManager(6, BS)
    parent = make_request("p", range(8))
    assert kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = parent.fork(1)
    kv.fork(parent, child)
    child.num_computed_tokens = 4  # pretend the child had not computed block 1: it would rewrite it
    with pytest.raises(AssertionError, match="shared block"):
        kv.allocate_slots(child, 1)


# ---- sliding window: blocks wholly before the window are released ---------------------------
WINDOW, WBS = 32, 16  # a query at p reads p - 31 .. p


def compute(kv: KVCacheManager, request: Request, num_new: int, live: list[Request] | None = None) -> int:
    """Allocate ``num_new`` tokens, 'compute' them, publish full blocks; the blocks the request holds."""
    assert kv.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new
    kv.cache_computed_blocks(request)
    kv.check_invariants(live or [request])
    return sum(b is not None for b in kv.tables[request.request_id])


def test_a_windowed_request_holds_only_the_blocks_its_window_reads():
    kv = KVCacheManager(20, WBS, sliding_window=WINDOW)
    a = make_request("a", range(100))
    held = [compute(kv, a, min(16, 100 - a.num_computed_tokens)) for _ in range(7)]  # chunked prefill
    # Before each chunk at p = 0, 16, ..., 96 the first (p - 31) // 16 blocks are released.
    assert held == [1, 2, 3, 3, 3, 3, 3]
    assert kv.num_free_blocks == 20 - 3
    assert kv.block_ids("a")[:4] == [HOLE_BLOCK_ID] * 4 and len(kv.block_ids("a")) == 7
    for token in range(16):  # decodes: 2 or 3 blocks
        a.append_token(1000 + token)
        assert compute(kv, a, 1) == (2 if a.num_computed_tokens - 1 in range(111, 112) else 3)
    kv.free(a)
    assert kv.num_free_blocks == 20
    kv.check_invariants([])


def test_released_blocks_go_back_to_the_free_queue_still_cached_and_the_runner_sees_holes():
    kv = KVCacheManager(10, WBS, sliding_window=WINDOW)
    a = make_request("a", range(64))
    compute(kv, a, 64)
    assert kv.take_block_ids_update("a") == (0, [0, 1, 2, 3])
    a.append_token(7)
    assert kv.allocate_slots(a, 1)  # next query at 64 reads 33..64: blocks 0 and 1 are out
    assert kv.take_block_ids_update("a") == (0, [HOLE_BLOCK_ID, HOLE_BLOCK_ID, 2, 3, 4])
    free = list(kv.pool.free_queue)
    assert [b.block_id for b in free[-2:]] == [1, 0]  # tail first, as a freed table
    assert all(b.block_hash is not None for b in free[-2:])  # still findable prefix-cache hits
    kv.check_invariants([a])


def test_prefix_hits_before_the_window_are_not_taken():
    kv = KVCacheManager(10, WBS, sliding_window=WINDOW)
    a = make_request("a", range(64))
    compute(kv, a, 64)
    kv.free(a)
    b = make_request("b", list(range(64)) + [5] * 5, arrival=1)
    computed, num_computed = kv.get_computed_blocks(b)
    assert num_computed == 64 and len(computed.blocks) == 4
    assert kv.allocate_slots(b, 5, computed)
    b.num_computed_tokens = 64
    # The query at 64 reads 33..64: hits 0 and 1 stay in the free queue (and the cache), 2 and 3 are taken.
    assert kv.block_ids("b")[:4] == [HOLE_BLOCK_ID, HOLE_BLOCK_ID, 2, 3]
    assert kv.num_free_blocks == 10 - 3
    assert {0, 1} <= {blk.block_id for blk in kv.pool.cached.values() if blk.ref_count == 0}
    kv.check_invariants([b])
    c = make_request("c", list(range(64)) + [6], arrival=2)  # the released hits are still valid for others
    assert kv.get_computed_blocks(c)[1] == 64


def test_fork_shares_holes_and_each_sequence_releases_its_own_references():
    kv = KVCacheManager(12, WBS, sliding_window=WINDOW)
    parent = make_request("p", range(40))
    compute(kv, parent, 40)
    child = make_request("c", range(40))
    child.num_computed_tokens = 40
    kv.fork(parent, child)
    assert [b.ref_count for b in kv.tables["p"]] == [2, 2, 2]
    for sequence in (parent, child):
        sequence.append_token(1)
    for _ in range(9):  # both decode to 49: the query at 49 reads 18..49, block 0 is out
        for sequence in (parent, child):
            compute(kv, sequence, 1, [parent, child])
            sequence.append_token(1)
    assert kv.tables["p"][0] is None and kv.tables["c"][0] is None
    # Each holds [hole, 1 (shared), its own copy of the forked tail, its own next block].
    assert kv.pool.blocks[0].ref_count == 0 and kv.pool.blocks[1].ref_count == 2
    assert kv.num_free_blocks == 12 - 1 - 2 * 2
    kv.free(parent)
    kv.check_invariants([child])
    kv.free(child)
    assert kv.num_free_blocks == 12
    kv.check_invariants([])


def test_a_request_longer_than_the_cache_runs_in_chunks_and_the_scheduler_admits_it():
    kv = KVCacheManager(4, WBS, sliding_window=WINDOW)
    assert kv.num_blocks_needed(100, 16) == 4 and KVCacheManager(4, WBS).num_blocks_needed(100, 16) == 7
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=16)
    a = make_request("a", range(100))
    scheduler.add_request(a)
    while a.num_computed_tokens < 100:
        out = scheduler.schedule()
        assert out.scheduled and not scheduler.take_failed()
        scheduler.update_from_output(out, [[5] if out.scheduled[0].samples else []])
        scheduler.check_invariants()
        assert sum(b is not None for b in kv.tables.get("a", [])) <= 4
    assert a.num_output_tokens == 1


def test_speculative_rollback_never_reaches_a_released_block():
    kv = KVCacheManager(10, WBS, sliding_window=WINDOW)
    a = make_request("a", range(63))
    compute(kv, a, 63)
    assert kv.allocate_slots(a, 1 + 4)  # the last token and four drafts from 63
    a.num_computed_tokens = 64  # every draft rejected: back to the step's start + 1
    kv.check_invariants([a])
    assert kv.num_holes["a"] == (63 - WINDOW + 1) // WBS == 2


def test_the_engine_gives_the_kv_manager_a_window_only_when_every_layer_slides():
    from paged_runtime.engine.core import kv_sliding_window
    from paged_runtime.models.config import ModelConfig
    shape = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2)
    mistral = ModelConfig.from_dict(dict(shape, architectures=["MistralForCausalLM"], sliding_window=24))
    qwen2 = ModelConfig.from_dict(dict(shape, architectures=["Qwen2ForCausalLM"], sliding_window=24,
                                       use_sliding_window=True, max_window_layers=2))
    plain_qwen2 = ModelConfig.from_dict(dict(shape, architectures=["Qwen2ForCausalLM"], sliding_window=24))
    assert mistral.layer_windows == (24,) * 4 and kv_sliding_window(mistral, None) == 24
    assert qwen2.layer_windows == (None, None, 24, 24) and kv_sliding_window(qwen2, None) is None
    assert plain_qwen2.layer_windows == () and kv_sliding_window(plain_qwen2, None) is None
    assert kv_sliding_window(mistral, mistral) is None  # a draft model's catch-up reads before the step
