"""Per-request block tables on top of the block pool: prefix caching and copy-on-write.

A request's block table is append-only while it runs and is released whole
(tail first) when it finishes or is preempted. ``allocate_slots`` is the only
way a table grows: it either reserves every slot asked for or nothing.

Prefix caching: once a block is full and its KV written, it is hashed with
``H(parent hash, its token ids, cache salt)`` and becomes findable. A new
request starts from the longest run of cached blocks of its tokens, capped
so that its last token is always computed (its logits are needed).

Copy-on-write: ``fork`` shares every block of a table, the partial tail
included, by reference count. A shared block is never written: before a
request appends into a shared partial tail, ``allocate_slots`` gives it a
private copy and records ``(src, dst)`` for the runner to copy first.
"""
from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np

from paged_runtime.core.block_pool import BlockPool, KVBlock
from paged_runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes, token_ids: list[int], salt: bytes) -> bytes:
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes() + salt).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[KVBlock]] = {}
        self.table_ids: dict[str, list[int]] = {}  # the same tables as plain ids, for the runner
        self.num_hashed_blocks: dict[str, int] = {}  # leading blocks of a table already cached
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next step
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # ---- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks at the start of ``request``'s tokens."""
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        self._hash_full_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, request: Request, num_hit_blocks: int) -> None:
        """Count a lookup that led to an admission (tokens queried, tokens found)."""
        if self.enable_caching:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_blocks * self.block_size

    def cache_computed_blocks(self, request: Request) -> None:
        """Hash and publish every block of ``request`` that is now full and written."""
        if not self.enable_caching or request.request_id not in self.tables:
            return
        table = self.tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        first = self.num_hashed_blocks.get(request.request_id, 0)
        if num_full <= first:
            return
        self._hash_full_blocks(request)
        for block, block_hash in zip(table[first:num_full], request.block_hashes[first:num_full]):
            self.pool.cache(block, block_hash)
        self.num_hashed_blocks[request.request_id] = num_full

    def _hash_full_blocks(self, request: Request) -> None:
        bs, hashes = self.block_size, request.block_hashes
        salt = request.cache_salt.encode() if request.cache_salt else b""
        for i in range(len(hashes), request.num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else b"", request.all_token_ids[i * bs:(i + 1) * bs], salt))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
        for request_id in self.num_hashed_blocks:
            self.num_hashed_blocks[request_id] = len(self.tables.get(request_id, ()))

    # ---- allocation ------------------------------------------------------------------
    def _plan(self, request: Request, num_new_tokens: int, computed: list[KVBlock]) -> tuple[int, bool]:
        """(new blocks to allocate, whether the tail must be copied first)."""
        table = self.tables.get(request.request_id) or computed
        num_computed = request.num_computed_tokens or len(computed) * self.block_size
        num_slots = num_computed + num_new_tokens
        copy_tail = bool(num_new_tokens and num_computed % self.block_size and table[-1].ref_count > 1)
        return max(0, cdiv(num_slots, self.block_size) - len(table)) + copy_tail, copy_tail

    def can_allocate(self, request: Request, num_new_tokens: int, computed: list[KVBlock] = ()) -> bool:
        num_blocks, _ = self._plan(request, num_new_tokens, list(computed))
        num_revived = sum(1 for b in computed if b.ref_count == 0)  # cached but sitting in the free queue
        return num_blocks + num_revived <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[KVBlock] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and ``computed``
        cache hits for a request that has no table yet); False, changing nothing, if short."""
        computed = list(computed)
        if not self.can_allocate(request, num_new_tokens, computed):
            return False
        num_blocks, copy_tail = self._plan(request, num_new_tokens, computed)
        if request.request_id not in self.tables:
            self.pool.touch(computed)
            self.tables[request.request_id] = computed
            self.table_ids[request.request_id] = [b.block_id for b in computed]
            self.num_hashed_blocks[request.request_id] = len(computed)
        table, ids = self.tables[request.request_id], self.table_ids[request.request_id]
        new_blocks = self.pool.allocate(num_blocks)
        if copy_tail:
            self._copy_on_write(table, ids, new_blocks.pop())
        table.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        return True

    def _copy_on_write(self, table: list[KVBlock], ids: list[int], private: KVBlock) -> None:
        shared = table[-1]
        shared.ref_count -= 1  # still >= 1: others hold it
        self.pending_copies.append((shared.block_id, private.block_id))
        table[-1], ids[-1] = private, private.block_id

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's table, every block shared (ref count + 1)."""
        blocks = self.tables[parent.request_id]
        self.pool.touch(blocks)
        self.tables[child.request_id] = list(blocks)
        self.table_ids[child.request_id] = list(self.table_ids[parent.request_id])
        self.num_hashed_blocks[child.request_id] = self.num_hashed_blocks.get(parent.request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        return self.table_ids.get(request_id, [])

    def free(self, request: Request) -> None:
        """Release the request's table, tail first so chains are evicted from their end."""
        blocks = self.tables.pop(request.request_id, [])
        self.table_ids.pop(request.request_id, None)
        self.num_hashed_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def check_invariants(self, requests: list[Request]) -> None:
        """Debug check: ref counts equal table membership, free iff ref 0, slots cover KV."""
        membership = Counter(b.block_id for table in self.tables.values() for b in table)
        free_ids = {b.block_id for b in self.pool.free_queue}
        for block in self.pool.blocks:
            assert block.ref_count == membership[block.block_id], f"{block} in {membership[block.block_id]} tables"
            assert (block.ref_count == 0) == (block.block_id in free_ids), f"{block} free-queue mismatch"
        assert len(free_ids) == self.pool.num_free_blocks
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"{block} cached under a stale hash"
        for request in requests:
            num_slots = len(self.tables.get(request.request_id, ())) * self.block_size
            assert request.num_computed_tokens <= num_slots, f"{request.request_id} computed past its slots"
        assert set(self.tables) <= {r.request_id for r in requests}, "table of an unknown request"
