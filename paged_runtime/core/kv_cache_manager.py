"""Per-request block tables on top of the block pool: prefix caching and copy-on-write.

A request's block table is append-only while it runs (copy-on-write may swap
its tail block for a private copy; a sliding window turns its oldest blocks into
holes, see below) and is released whole (tail first) when it finishes or is
preempted. ``allocate_slots`` is the only way a table grows: it either reserves
every slot asked for or nothing.

Prefix caching: once a block is full and its KV written, it is hashed with
``H((parent hash, its token ids, extra keys))`` (vLLM's definition, ``core/block_hash.py``: the cache salt is
the first block's extra key) and becomes findable. A new request starts from the longest run of cached blocks
of its tokens, capped so that its last token is always computed (its logits are needed).

KV-cache events (``core/kv_events.py``): with a recorder, every block that becomes findable is recorded as
stored (its hash, its parent's, its tokens) when ``pool.cache`` takes it; the pool records what leaves.

Copy-on-write: ``fork`` shares every block of a table, the partial tail
included, by reference count. A shared block is never written: before a
request appends into a shared partial tail, ``allocate_slots`` gives it a
private copy and records ``(src, dst)`` for the runner to copy first.

Sliding window (``sliding_window`` W, given only when EVERY attention layer slides, as
Mistral's do): the next query at position p = num_computed reads keys p - W + 1 .. p only, and
later queries read later keys, so a block wholly before p - W + 1 is never read again by the
request. ``allocate_slots`` releases such blocks first (from the step's computed count: a
speculative rollback never goes below it) and leaves a hole in their place, so positions keep
their table index: ``None`` in the block table, ``HOLE_BLOCK_ID`` in the runner's ids (a real
slot range: the torch backend's full-context gather reads finite values there and masks them,
the kernels never read it). Holes are always a prefix of the table. A released block keeps its
hash in the free queue like any freed block, so it stays a valid prefix-cache hit until handed
out again; the lookup walks the chain from the start and stops at the first miss, so a hit
never includes a block whose KV is gone. Admission takes only the hits inside the window.
A model with full-context layers too (Gemma 3's global layers) passes no window: every block
is kept, as without one.

The scheduler never sees a block: ``get_computed_blocks`` gives it an opaque
``ComputedBlocks`` (handed back to ``allocate_slots``) and a token count, and
the runner gets block ids. ``take_block_ids_update`` says how a request's id
table changed since the last take, so only the change need be sent::

    table before: [7, 3, 9]            allocate 1 more  -> (3, [4])
    table before: [7, 3, 9(shared)]    copy-on-write    -> (2, [5])
    freed, then re-admitted with [7, 2]                 -> (0, [7, 2])
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from paged_runtime.core.block_hash import BlockHasher, block_extra_keys
from paged_runtime.core.block_pool import BlockPool, KVBlock
from paged_runtime.core.kv_events import KVEventRecorder
from paged_runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_needed(num_tokens: int, block_size: int, sliding_window: int | None, max_chunk: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once, computed ``max_chunk`` tokens a step
    at most: all of them; with a window, at most the window's and a chunk's, plus one partly read block."""
    num_blocks = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return num_blocks
    return min(num_blocks, cdiv(sliding_window - 1 + max_chunk, block_size) + 1)


@dataclass(slots=True, frozen=True)
class ComputedBlocks:
    """Prefix-cache hits for a request that has no table yet. Opaque to the scheduler, which only
    hands them back to ``allocate_slots`` before the pool changes (blocks in the free queue could
    be handed out to someone else)."""
    blocks: tuple[KVBlock, ...] = ()


NO_COMPUTED_BLOCKS = ComputedBlocks()
# What the runner's id table holds where a released block was: any real block does (never written through
# a hole; read only by the torch backend's gather, which masks it).
HOLE_BLOCK_ID = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, hash_algo: str = "sha256",
                 events: KVEventRecorder | None = None) -> None:
        """``sliding_window``: every attention layer's window (the largest, if they differ): blocks wholly
        before the next query's window are released. None (any full-context layer): every block is kept.
        ``hash_algo``: the block hash (``block_hash.HASH_FUNCTIONS``); ``events``: where KV-cache events go
        (None: none are recorded)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.hasher = BlockHasher(hash_algo)
        self.events = events
        self.pool = BlockPool(num_blocks, events)
        self.tables: dict[str, list[KVBlock | None]] = {}  # None: a hole (released, outside the window)
        self.num_holes: dict[str, int] = {}  # leading holes of each table
        self.table_ids: dict[str, list[int]] = {}  # the same tables as plain ids, for the runner
        self.num_hashed_blocks: dict[str, int] = {}  # leading blocks of a table already offered to the cache
        # Per request: the first index of its id table the runner has not been told about
        # (absent: nothing changed since the last take_block_ids_update).
        self.first_changed: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next step
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # ---- prefix cache --------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """The longest run of cached blocks at the start of ``request``'s tokens, and the number of
        tokens they hold (a multiple of the block size, always < ``request.num_tokens``)."""
        if not self.enable_caching or request.skip_prefix_cache:
            return NO_COMPUTED_BLOCKS, 0
        self._hash_full_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(tuple(hits)), len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count a lookup that led to an admission (tokens queried, tokens found)."""
        if self.enable_caching:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_tokens

    def cache_computed_blocks(self, request: Request, num_written: int | None = None) -> None:
        """Hash and publish every block of ``request`` that is now full and written: within its first
        ``num_written`` tokens (default: its computed count)."""
        if not self.enable_caching or request.request_id not in self.tables:
            return
        table = self.tables[request.request_id]
        num_written = request.num_computed_tokens if num_written is None else num_written
        num_full = min(num_written // self.block_size, len(table))
        first = self.num_hashed_blocks.get(request.request_id, 0)
        if num_full <= first:
            return
        self._hash_full_blocks(request)
        for i in range(first, num_full):
            block = table[i]  # never offered before: past this table's hashed count; a hole has no KV to offer
            if block is not None and self.pool.cache(block, request.block_hashes[i]) and self.events is not None:
                self._record_stored(request, i)
        self.num_hashed_blocks[request.request_id] = num_full

    def _record_stored(self, request: Request, i: int) -> None:
        hashes, bs = request.block_hashes, self.block_size
        self.events.stored(hashes[i], hashes[i - 1] if i else None, request.all_token_ids[i * bs:(i + 1) * bs],
                           request.lora_id or None, request.lora_name)

    def _hash_full_blocks(self, request: Request) -> None:
        bs, hashes = self.block_size, request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            extra_keys = block_extra_keys(i, request.lora_name, request.cache_salt)
            hashes.append(self.hasher(hashes[-1] if hashes else None, request.all_token_ids[i * bs:(i + 1) * bs],
                                      extra_keys))

    def reset_prefix_cache(self) -> None:
        """Forget every hash; the blocks now in tables are not offered to the cache again."""
        self.pool.reset_cache()
        for request_id in self.num_hashed_blocks:
            self.num_hashed_blocks[request_id] = len(self.tables.get(request_id, ()))

    # ---- allocation ------------------------------------------------------------------
    def _num_outside_window(self, num_computed: int) -> int:
        """Leading blocks that no query from position ``num_computed`` on reads (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def num_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once here (``blocks_needed``)."""
        return blocks_needed(num_tokens, self.block_size, self.sliding_window, max_chunk)

    def _releasable(self, request: Request) -> list[KVBlock]:
        """Blocks of ``request``'s table now wholly before its window and not yet released."""
        table = self.tables.get(request.request_id)
        if table is None:
            return []
        end = min(self._num_outside_window(request.num_computed_tokens), len(table))
        return table[self.num_holes[request.request_id]:end]

    def _release_outside_window(self, request: Request) -> None:
        """Give back the blocks no later query of ``request`` reads; holes keep their positions."""
        released = self._releasable(request)
        if not released:
            return
        request_id = request.request_id
        first = self.num_holes[request_id]
        end = first + len(released)
        self.tables[request_id][first:end] = [None] * len(released)
        self.table_ids[request_id][first:end] = [HOLE_BLOCK_ID] * len(released)
        self.num_holes[request_id] = end
        self.pool.free(reversed(released))
        self.mark_changed(request_id, first)

    def _plan(self, request: Request, num_new_tokens: int, computed: ComputedBlocks) -> tuple[int, bool, int]:
        """(new blocks to allocate, whether the tail must be copied first, tokens already computed)."""
        table, num_computed = self._current(request, computed)
        num_slots = num_computed + num_new_tokens
        copy_tail = bool(num_new_tokens and num_computed % self.block_size and table[-1].ref_count > 1)
        return max(0, cdiv(num_slots, self.block_size) - len(table)) + copy_tail, copy_tail, num_computed

    def _current(self, request: Request, computed: ComputedBlocks) -> tuple[Sequence[KVBlock], int]:
        """The table to grow and the tokens in it: the cache hits' for a request without a table."""
        table = self.tables.get(request.request_id)
        if table is None:
            num_computed = len(computed.blocks) * self.block_size
            assert request.num_computed_tokens in (0, num_computed), f"{request.request_id} has KV but no table"
            return computed.blocks, num_computed
        assert not computed.blocks, f"{request.request_id} already has a table: cache hits are for admission"
        return table, request.num_computed_tokens

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: ComputedBlocks = NO_COMPUTED_BLOCKS) -> bool:
        """Whether ``allocate_slots`` would succeed: the blocks it takes (new ones, and cache hits inside the
        window sitting in the free queue) against the free ones plus those it releases first."""
        num_blocks, _, _ = self._plan(request, num_new_tokens, computed)
        kept = computed.blocks[self._num_outside_window(len(computed.blocks) * self.block_size):]
        num_revived = sum(1 for b in kept if b.ref_count == 0)  # cached but sitting in the free queue
        num_released = sum(1 for b in self._releasable(request) if b.ref_count == 1)
        return num_blocks + num_revived <= self.pool.num_free_blocks + num_released

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = NO_COMPUTED_BLOCKS) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and ``computed``
        cache hits for a request that has no table yet); False if short, having changed nothing but
        released blocks outside the window (never read again either way)."""
        self._release_outside_window(request)
        if not self.can_allocate(request, num_new_tokens, computed):
            return False
        num_blocks, copy_tail, num_computed = self._plan(request, num_new_tokens, computed)
        request_id = request.request_id
        if request_id not in self.tables:
            self._new_table(request, computed)
        table, ids = self.tables[request_id], self.table_ids[request_id]
        num_old = len(table)
        new_blocks = self.pool.allocate(num_blocks)
        if copy_tail:
            self._copy_on_write(request_id, new_blocks.pop())
        table.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        if new_blocks:
            self.mark_changed(request_id, num_old)
        self._assert_private(request_id, num_computed, num_new_tokens)
        return True

    def _assert_private(self, request_id: str, num_computed: int, num_new_tokens: int) -> None:
        """A shared block is never written: every block the new tokens land in is this table's alone."""
        if num_new_tokens:
            first, end = num_computed // self.block_size, cdiv(num_computed + num_new_tokens, self.block_size)
            written = self.tables[request_id][first:end]
            assert all(b.ref_count == 1 for b in written), f"{request_id} would write a shared block"

    def _new_table(self, request: Request, computed: ComputedBlocks) -> None:
        """Start ``request``'s table from its cache hits (which must still be cached); those wholly before
        the window are holes from the start, never taken."""
        for block, block_hash in zip(computed.blocks, request.block_hashes):
            assert block.block_hash == block_hash, f"stale cache hit {block}: the pool changed since the lookup"
        num_holes = self._num_outside_window(len(computed.blocks) * self.block_size)
        kept = computed.blocks[num_holes:]
        self.pool.touch(kept)
        self.tables[request.request_id] = [None] * num_holes + list(kept)
        self.table_ids[request.request_id] = [HOLE_BLOCK_ID] * num_holes + [b.block_id for b in kept]
        self.num_holes[request.request_id] = num_holes
        self.num_hashed_blocks[request.request_id] = len(computed.blocks)
        self.first_changed[request.request_id] = 0  # a new table: the runner takes it whole

    def _copy_on_write(self, request_id: str, private: KVBlock) -> None:
        table, ids = self.tables[request_id], self.table_ids[request_id]
        shared = table[-1]
        shared.ref_count -= 1  # still >= 1: others hold it
        self.pending_copies.append((shared.block_id, private.block_id))
        table[-1], ids[-1] = private, private.block_id
        self.mark_changed(request_id, len(table) - 1)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def restore_pending_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copies taken for a step that never ran: they come first in the next take."""
        self.pending_copies[:0] = copies

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's table, every block shared (ref count + 1)."""
        assert child.request_id not in self.tables, f"{child.request_id} already has a table"
        blocks = self.tables[parent.request_id]
        self.pool.touch(b for b in blocks if b is not None)
        self.tables[child.request_id] = list(blocks)
        self.num_holes[child.request_id] = self.num_holes[parent.request_id]
        self.table_ids[child.request_id] = list(self.table_ids[parent.request_id])
        self.num_hashed_blocks[child.request_id] = self.num_hashed_blocks.get(parent.request_id, 0)
        self.first_changed[child.request_id] = 0

    def block_ids(self, request_id: str) -> list[int]:
        return self.table_ids.get(request_id, [])

    def mark_changed(self, request_id: str, first: int) -> None:
        self.first_changed[request_id] = min(first, self.first_changed.get(request_id, first))

    def take_block_ids_update(self, request_id: str) -> tuple[int, list[int]] | None:
        """How ``request_id``'s id table changed since the last take: ``(first, ids)`` means the
        table is now ``table_at_last_take[:first] + ids``; None if nothing changed (or it has no
        table). A new table (admission, re-admission after preemption, fork) gives first = 0."""
        first = self.first_changed.pop(request_id, None)
        if first is None:
            return None
        return first, self.table_ids[request_id][first:]

    def free(self, request: Request) -> None:
        """Release the request's table, tail first so chains are evicted from their end."""
        blocks = self.tables.pop(request.request_id, [])
        self.table_ids.pop(request.request_id, None)
        self.num_holes.pop(request.request_id, None)
        self.num_hashed_blocks.pop(request.request_id, None)
        self.first_changed.pop(request.request_id, None)
        self.pool.free(reversed([b for b in blocks if b is not None]))

    def check_invariants(self, requests: list[Request]) -> None:
        """Debug check: ref counts equal table membership, free iff ref 0, slots cover KV."""
        self.pool.check_invariants()
        membership = Counter(b.block_id for table in self.tables.values() for b in table if b is not None)
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
            num_holes = self.num_holes.get(request.request_id, 0)
            assert num_holes <= self._num_outside_window(request.num_computed_tokens), \
                f"{request.request_id} released a block its next query reads"
        assert set(self.tables) <= {r.request_id for r in requests}, "table of an unknown request"
        for request_id, table in self.tables.items():
            self._check_table(request_id, table)
        assert set(self.first_changed) <= set(self.tables), "an update pending for a freed table"

    def _check_table(self, request_id: str, table: list[KVBlock]) -> None:
        """Ids mirror blocks; blocks past the hashed count carry no hash (so ``pool.cache`` never
        sees a block twice); a pending update starts inside the table."""
        num_holes = self.num_holes[request_id]
        assert all(b is None for b in table[:num_holes]), f"{request_id} has a block among its holes"
        assert all(b is not None for b in table[num_holes:]), f"{request_id} has a hole after a block"
        assert self.table_ids[request_id] == [HOLE_BLOCK_ID] * num_holes + [b.block_id for b in table[num_holes:]], \
            f"{request_id} ids out of sync"
        num_hashed = self.num_hashed_blocks[request_id]
        assert num_hashed <= len(table), f"{request_id} hashed past its table"
        assert all(b.block_hash is None for b in table[max(num_hashed, num_holes):]), \
            f"{request_id} has a hash past its hashed count"
        assert 0 <= self.first_changed.get(request_id, 0) <= len(table)
