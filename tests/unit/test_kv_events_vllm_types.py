"""Our KV-event batches against the structs vLLM declares (``vllm/distributed/kv_events.py``), rebuilt here with
msgspec as vLLM builds them: vLLM's own decoder types read our batches, and where vLLM's structs hold exactly
the fields we send, its encoder writes our bytes.

(No ``from __future__ import annotations``: msgspec resolves the local structs' annotations as objects.)
"""
from typing import Any

import pytest

from paged_runtime.core.block_hash import low_64_bits
from paged_runtime.core.kv_events import EVENT_FORMATS, AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

msgspec = pytest.importorskip("msgspec")

BS = 4
H = [bytes([i]) * 32 for i in range(8)]
EVENTS = [BlockStored([H[1], H[2]], H[0], [5, 6, 7, 8, 9, 10, 11, 12], BS), BlockRemoved([H[3], H[4]]),
          AllBlocksCleared(), BlockStored([H[5]], None, [1, 2, 3, 4], BS)]


def low64(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def vllm_types(array_like: bool, later_fields: bool):
    """vLLM's tagged event structs, positional (up to 0.25) or by name (0.26 on); with ``later_fields``, every
    field vLLM has appended since (each defaulting to None), else ending at ``lora_name`` as in vLLM 0.13."""

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None

    if later_fields:
        class BlockStored(BlockStored, tag="BlockStored"):  # noqa: F811 (vLLM 0.2x's, by extension)
            extra_keys: list | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

        class BlockRemoved(BlockRemoved, tag="BlockRemoved"):  # noqa: F811
            group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


@pytest.mark.parametrize("layout", EVENT_FORMATS)
def test_vllms_own_structs_decode_our_batches(layout):
    KVEventBatch, Stored, Removed, Cleared = vllm_types(layout == "array", later_fields=True)
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(encode_batch(3.0, EVENTS, layout, low_64_bits))
    assert (batch.ts, batch.data_parallel_rank) == (3.0, 0)
    stored, removed, cleared, first = batch.events
    assert stored == Stored([low64(H[1]), low64(H[2])], low64(H[0]), [5, 6, 7, 8, 9, 10, 11, 12], BS, None, "GPU",
                            None)
    assert removed == Removed([low64(H[3]), low64(H[4])], "GPU") and isinstance(cleared, Cleared)
    assert first.parent_block_hash is None and first.extra_keys is None and first.group_idx is None


@pytest.mark.parametrize("layout", EVENT_FORMATS)
def test_vllms_encoder_writes_our_bytes_for_the_fields_we_send(layout):
    """msgspec writes every field of an array-like struct, so the bytes match where vLLM's structs end at
    ``lora_name``; in maps it leaves out fields at their default, so they match whatever the later fields."""
    KVEventBatch, Stored, Removed, Cleared = vllm_types(layout == "array", later_fields=layout == "map")
    theirs = KVEventBatch(1.5, [Stored([low64(H[1]), low64(H[2])], low64(H[0]), [5, 6, 7, 8, 9, 10, 11, 12], BS,
                                       None, "GPU", None),
                                Removed([low64(H[3]), low64(H[4])], "GPU"), Cleared(),
                                Stored([low64(H[5])], None, [1, 2, 3, 4], BS, None, "GPU", None)], 0)
    assert encode_batch(1.5, EVENTS, layout, low_64_bits) == msgspec.msgpack.encode(theirs)
