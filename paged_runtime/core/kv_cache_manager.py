"""Per-request block tables on top of the block pool.

A request's block table is append-only while it runs and is released whole
(tail first) when it finishes or is preempted. ``allocate_slots`` is the only
way a table grows: it either reserves every slot asked for or nothing.
"""
from __future__ import annotations

from collections import Counter

from paged_runtime.core.block_pool import BlockPool, KVBlock
from paged_runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[KVBlock]] = {}
        self.table_ids: dict[str, list[int]] = {}  # the same tables as plain ids, for the runner

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_slots, self.block_size) - len(self.tables.get(request.request_id, ())))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False if the pool is short."""
        if not self.can_allocate(request, num_new_tokens):
            return False
        blocks = self.pool.allocate(self.num_blocks_needed(request, num_new_tokens))
        self.tables.setdefault(request.request_id, []).extend(blocks)
        self.table_ids.setdefault(request.request_id, []).extend(b.block_id for b in blocks)
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return self.table_ids.get(request_id, [])

    def free(self, request: Request) -> None:
        """Release the request's table, tail first so chains are evicted from their end."""
        blocks = self.tables.pop(request.request_id, [])
        self.table_ids.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def check_invariants(self, requests: list[Request]) -> None:
        """Debug check: ref counts equal table membership, free iff ref 0, slots cover KV."""
        membership = Counter(b.block_id for table in self.tables.values() for b in table)
        free_ids = {b.block_id for b in self.pool.free_queue}
        for block in self.pool.blocks:
            assert block.ref_count == membership[block.block_id], f"{block} in {membership[block.block_id]} tables"
            assert (block.ref_count == 0) == (block.block_id in free_ids), f"{block} free-queue mismatch"
        assert len(free_ids) == self.pool.num_free_blocks
        for request in requests:
            num_slots = len(self.tables.get(request.request_id, ())) * self.block_size
            assert request.num_computed_tokens <= num_slots, f"{request.request_id} computed past its slots"
        assert set(self.tables) <= {r.request_id for r in requests}, "table of an unknown request"
