"""The pool of KV-cache blocks and its O(1) LRU free queue.

Invariants:
- a block's ``ref_count`` is the number of block tables holding it;
- a block is in the free queue iff its ``ref_count`` is 0;
- the free queue is LRU: the head is the next block handed out. Freed blocks
  go to the tail, so recently used ones (and their cached prefixes) survive
  longest;
- a block with a hash is findable in ``cached`` until it is handed out again:
  a freed block keeps its KV and its hash, which is what the prefix cache is;
- ``cached`` maps each hash to the one block carrying it: a block is hashed at
  most once until ``allocate`` or ``reset_cache`` clears its hash;
- with a ``KVEventRecorder`` (KV-cache events on), every hash leaving ``cached`` is reported: one
  ``removed`` per evicted hash, one ``cleared`` per reset (the KV-cache manager reports what ``cache``
  adds, knowing the tokens). Without one, nothing is recorded and nothing costs.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from paged_runtime.core.kv_events import KVEventRecorder


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_count})"


class FreeBlockQueue:
    """Intrusive doubly linked list over ``KVBlock``: O(1) pop, append, remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks in the hot path
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block not in free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every block; hands out free ones and takes them back."""

    def __init__(self, num_blocks: int, events: KVEventRecorder | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> the block holding that KV
        self.events = events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (ref 1)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_count = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on held or cached blocks, pulling free ones out of the queue."""
        for block in blocks:
            assert block.ref_count > 0 or block.block_hash is not None, f"{block} is free and uncached: its KV is gone"
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Make a full, written block findable by its hash (the first holder of a hash wins); whether it did.

        A block is hashed at most once between hand-outs: only ``allocate`` (eviction) or
        ``reset_cache`` clears a hash, and callers never offer an already hashed block again.
        The block must be held: only a table's owner writes KV into it.
        """
        assert block.block_hash is None, f"{block} is already cached; it must be evicted or reset first"
        assert block.ref_count > 0, f"{block} is free: nobody wrote its KV"
        if block_hash in self.cached:  # an equal block got there first; this one stays plain
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None

    def reset_cache(self) -> None:
        """Forget every hash; blocks in use keep their KV, cached free blocks become plain free ones."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (pass tail first)."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def check_invariants(self) -> None:
        """The free queue holds exactly the blocks with ref 0, once each; the cache maps each hash to its block."""
        free = list(self.free_queue)
        assert len(free) == self.num_free_blocks == len({b.block_id for b in free}), "free queue count is off"
        assert all(b.ref_count == 0 for b in free), "a held block is in the free queue"
        assert sum(b.ref_count == 0 for b in self.blocks) == len(free), "a free block is missing from the queue"
        assert all(b.ref_count >= 0 for b in self.blocks), "a negative ref count"
        assert all(block.block_hash == h for h, block in self.cached.items()), "a block cached under a stale hash"

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
