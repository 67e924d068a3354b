"""Block pool and KV-cache manager: exact counts, LRU order, ref counts."""
from __future__ import annotations

import pytest

from paged_runtime.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.request import Request
from paged_runtime.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt: int, arrival: int = 0) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams(), arrival, max_tokens=100)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_is_a_linked_list_with_o1_remove():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert ids(queue) == [1, 3, 4, 2]
    for _ in range(4):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()


def test_pool_allocates_from_head_and_frees_to_tail():
    pool = BlockPool(6)
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert ids(first) == [0, 1] and ids(second) == [2, 3, 4]
    assert pool.num_free_blocks == 1 and all(b.ref_count == 1 for b in first + second)
    pool.free(reversed(first))
    assert ids(pool.free_queue) == [5, 1, 0]  # least recently freed is reused first
    assert ids(pool.allocate(2)) == [5, 1]
    with pytest.raises(ValueError):
        pool.allocate(2)


def test_ref_counts_and_double_free():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    block.ref_count += 1  # a second table holds it
    pool.free([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert block.ref_count == 0 and pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.free([block])


def test_manager_allocates_exact_block_counts():
    kv = KVCacheManager(num_blocks=10, block_size=16)
    request = make_request("a", 40)
    assert kv.allocate_slots(request, 40) and kv.num_free_blocks == 7  # ceil(40 / 16) = 3
    request.num_computed_tokens = 40
    assert kv.allocate_slots(request, 8) and kv.num_free_blocks == 7  # 48 slots fit in 3 blocks
    assert kv.allocate_slots(request, 9) and kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 6
    kv.check_invariants([request])


def test_manager_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    big = make_request("big", 100)
    assert not kv.allocate_slots(big, 100)  # needs 7 blocks
    assert kv.num_free_blocks == 4 and kv.block_ids("big") == []


def test_manager_frees_tail_first():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a, b = make_request("a", 12), make_request("b", 8)
    kv.allocate_slots(a, 12)
    kv.allocate_slots(b, 8)
    kv.free(a)
    assert ids(kv.pool.free_queue) == [2, 1, 0]  # the chain's end is evicted first
    assert kv.usage() == pytest.approx(0.4)
    kv.check_invariants([b])
