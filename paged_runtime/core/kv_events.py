"""KV-cache events in vLLM's schema (``--kv-events-config``): what the block pool stored, evicted or cleared.

The pool and the KV-cache manager report to a ``KVEventRecorder`` (none when events are off: no work at all);
the engine core takes its events once per step and hands them, as one batch, to a publisher
(``engine/kv_event_publisher.py``), which encodes and sends them off the step loop.

Events (vLLM's ``vllm/distributed/kv_events.py``; tags are the class names, fields in vLLM's order):

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name)``: full
  blocks that became findable by their hash, a chain: ``parent_block_hash`` is the hash before the first one
  (None: they start a prompt), ``token_ids`` are the blocks' tokens end to end;
- ``BlockRemoved(block_hashes, medium)``: hashes no block carries any more (evicted);
- ``AllBlocksCleared()``: the prefix cache was reset; every hash is gone.

``medium`` is ``"GPU"``, vLLM's name for the engine's own KV cache whatever the device (``"CPU"`` there means
an offloading tier, which this runtime has none of); ``lora_id`` and ``lora_name`` name the adapter whose KV the
blocks hold (None: the base model's). The fields vLLM appended later, each defaulting to None (``extra_keys``, ``group_idx``,
``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``), are left out: a decoder of either layout reads an
absent one as its default (msgspec's structs; llm-d's positional structs end at ``lora_name``), and the
first-block extra keys would publish cache salts. (msgspec writes every field of an ``array_like`` struct,
``omit_defaults`` notwithstanding, so vLLM 0.13-0.25 arrays carry those fields as trailing elements, which
decoders that do not know them skip.)

A batch on the wire (``encode_batch``) is msgpack of ``[ts, [event, ...], data_parallel_rank]`` (vLLM's
``EventBatch``; rank 0: one engine, one publisher, whatever its tensor / pipeline ranks). Each event is laid out
as one of vLLM's two generations (``--kv-events-format``):

- ``array`` (vLLM up to 0.25: msgspec ``array_like=True, tag=True``): ``["BlockStored", hashes, parent,
  token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", hashes, medium]``,
  ``["AllBlocksCleared"]``;
- ``map`` (vLLM 0.26 on, after vllm-project/vllm#42892): ``{"type": "BlockStored", "block_hashes": ...}``,
  the same fields by name.

Block hashes are the cache's own (``core/block_hash.py``), sent as ``block_hash.external_hash_form`` says: by
default the low 64 bits as an unsigned integer, as vLLM sends them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

from paged_runtime.settings import json_object

MEDIUM_GPU = "GPU"
PUBLISHERS = ("null", "zmq")
EVENT_FORMATS = ("array", "map")  # config.KV_EVENTS_FORMATS names exactly these


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: its keys, defaults and meaning. ``publisher`` None becomes "zmq" when events
    are enabled, else "null" (as vLLM). ``max_queue_size`` bounds the batches waiting for the sender thread
    (beyond it a batch is dropped and counted, never waited for); ``hwm`` is the PUB socket's high-water mark;
    ``buffer_steps`` the batches kept for replay."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _check_types(self)
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}; "
                             f"got {self.publisher!r}")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"kv_events_config.{name} must be at least {low}, got {getattr(self, name)}")

    @property
    def active(self) -> bool:
        """Whether events are recorded and sent (enabled, and a publisher that sends)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """From a dict, a JSON object's text (``--kv-events-config``) or None; unknown keys are refused."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return cls(**json_object(value, "kv_events_config", [f.name for f in fields(cls)]))


_KIND_NAMES = {bool: "a boolean", int: "an integer", str: "a string"}


def _check_types(config: KVEventsConfig) -> None:
    """Each key holds its default's type (a key whose default is None: a string, or None)."""
    for f in fields(config):
        value, kind = getattr(config, f.name), str if f.default is None else type(f.default)
        if value is None and f.default is None:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"kv_events_config.{f.name} must be {_KIND_NAMES[kind]}, got {value!r}")


# ---- the events ----------------------------------------------------------------------------------------------
# Each event's fields on the wire, in vLLM's order (the array layout's positions, the map layout's keys).
WIRE_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                               "lora_name"),
               "BlockRemoved": ("block_hashes", "medium"),
               "AllBlocksCleared": ()}


@dataclass(slots=True)
class BlockStored:
    TAG: ClassVar[str] = "BlockStored"
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None

    def wire(self, external: Callable[[bytes], Any]) -> list[Any]:
        """The values of ``WIRE_FIELDS[TAG]``, hashes in their ``external`` form."""
        parent = None if self.parent_block_hash is None else external(self.parent_block_hash)
        return [[external(h) for h in self.block_hashes], parent, self.token_ids, self.block_size, self.lora_id,
                MEDIUM_GPU, self.lora_name]


@dataclass(slots=True)
class BlockRemoved:
    TAG: ClassVar[str] = "BlockRemoved"
    block_hashes: list[bytes]

    def wire(self, external: Callable[[bytes], Any]) -> list[Any]:
        return [[external(h) for h in self.block_hashes], MEDIUM_GPU]


@dataclass(slots=True)
class AllBlocksCleared:
    TAG: ClassVar[str] = "AllBlocksCleared"

    def wire(self, external: Callable[[bytes], Any]) -> list[Any]:
        return []


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """One step's events, in the order they happened; O(1) per block (plus the block's token ids).

    A stored block that chains onto the last event's last block extends that ``BlockStored`` (one event per run
    of a request's blocks, as vLLM sends one per caching call); removals in a row share one ``BlockRemoved``.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int], lora_id: int | None = None,
               lora_name: str | None = None) -> None:
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent
                and last.lora_id == lora_id):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self._events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, lora_id,
                                            lora_name))

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last take (the recorder keeps no reference to them)."""
        events, self._events = self._events, []
        return events


# ---- the wire --------------------------------------------------------------------------------------------------
def encode_event(event: KVEvent, layout: str, external: Callable[[bytes], Any]) -> list | dict:
    """One event as vLLM lays it out: a tagged array, or (``map``) a map with the tag under "type"."""
    values = event.wire(external)
    if layout == "map":
        return {"type": event.TAG, **dict(zip(WIRE_FIELDS[event.TAG], values))}
    return [event.TAG, *values]


def decode_event(event: list | dict) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) of one event in either layout; fields a sender left out are absent. ValueError
    for an unknown tag (a newer sender's event: the caller skips it)."""
    if isinstance(event, dict):
        tag, values = event.get("type"), {k: v for k, v in event.items() if k != "type"}
    else:
        tag, values = event[0], dict(zip(WIRE_FIELDS.get(event[0], ()), event[1:]))
    if tag not in WIRE_FIELDS:
        raise ValueError(f"unknown KV event {tag!r}")
    return tag, values


def decode_batch(payload: bytes) -> tuple[float, list, int]:
    """``encode_batch``'s inverse: (ts, [event as sent], data_parallel_rank)."""
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    return ts, events, rank


def encode_batch(ts: float, events: Sequence[KVEvent], layout: str, external: Callable[[bytes], Any],
                 data_parallel_rank: int = 0) -> bytes:
    """vLLM's ``KVEventBatch`` as msgpack: ``[ts, [event, ...], data_parallel_rank]`` (ts a float64)."""
    if layout not in EVENT_FORMATS:
        raise ValueError(f"kv_events_format must be one of {', '.join(EVENT_FORMATS)}; got {layout!r}")
    body = [ts, [encode_event(e, layout, external) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)
