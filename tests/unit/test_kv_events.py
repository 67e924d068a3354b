"""KV-cache events in vLLM's schema and vLLM's block hashes: the config, the encoding (decoded back with plain
msgpack; against vLLM's own struct declarations in ``test_kv_events_vllm_types.py``), the hashes (recomputed from
vLLM's published definition with hashlib and the tests' own CBOR encoder, ``helpers/kv_events.py``), the events
the KV-cache manager records, and the ZMQ publisher (framing, replay, drops, close) through real sockets."""
from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys
import threading
import time
import uuid

import msgpack
import pytest
import zmq

from tests.helpers.kv_events import END_SEQ, ask_replay, low64, receive, vllm_block_hashes
from paged_runtime import config as settings
from paged_runtime.core.block_hash import HASH_FUNCTIONS, BlockHasher, low_64_bits
from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.core.kv_events import (EVENT_FORMATS, AllBlocksCleared, BlockRemoved, BlockStored,
                                          KVEventRecorder, KVEventsConfig, encode_batch)
from paged_runtime.engine.kv_event_publisher import ZmqEventPublisher, binds, make_publisher
from paged_runtime.request import Request
from paged_runtime.sampling_params import SamplingParams

BS = 4
H = [bytes([i]) * 32 for i in range(8)]  # stand-in 32-byte block hashes


# ---- the config ------------------------------------------------------------------------------------------------
def test_config_takes_vllms_keys_and_defaults():
    assert KVEventsConfig.parse(None) is None
    off = KVEventsConfig.parse("{}")
    assert (off.enable_kv_cache_events, off.publisher, off.endpoint, off.replay_endpoint, off.buffer_steps,
            off.hwm, off.max_queue_size, off.topic) == (False, "null", "tcp://*:5557", None, 10_000, 100_000,
                                                        100_000, "")
    assert not off.active
    on = KVEventsConfig.parse({"enable_kv_cache_events": True, "topic": "kv"})
    assert on.publisher == "zmq" and on.active  # vLLM: no publisher named and enabled -> zmq
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).active


@pytest.mark.parametrize("value, message", [
    ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}', r"unknown keys \['endpiont'\]; its keys are"),
    ("{not json", "not valid JSON"),
    ("[1]", "must be an object"),
    ({"publisher": "kafka"}, "publisher must be one of null, zmq"),
    ({"buffer_steps": 0}, "buffer_steps must be at least 1"),
    ({"hwm": "10"}, "hwm must be an integer"),
    ({"enable_kv_cache_events": 1}, "enable_kv_cache_events must be a boolean"),
    ({"replay_endpoint": 5558}, "replay_endpoint must be a string"),
])
def test_config_refuses_what_vllm_would_not_take(value, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(value)


def test_the_settings_parse_the_flag_and_declare_exactly_the_implemented_choices():
    config = settings.EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "topic": "t"}',
                                   prefix_caching_hash_algo="sha256_cbor", kv_events_format="map")
    assert config.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, topic="t")
    assert settings.EngineConfig().kv_events_config is None
    assert tuple(HASH_FUNCTIONS) == settings.PREFIX_CACHING_HASH_ALGOS
    assert EVENT_FORMATS == settings.KV_EVENTS_FORMATS
    with pytest.raises(ValueError, match="unknown keys"):
        settings.EngineConfig(kv_events_config={"enabled": True})


def test_the_json_flag_reaches_the_engine_config_on_every_front_end():
    from kserve_adapter.args import parse_args as kserve_args
    from paged_runtime.entrypoints.cli import build_parser, engine_config
    from rayserve_adapter.args import AppArgs
    text, expected = '{"enable_kv_cache_events": true, "topic": "kv"}', KVEventsConfig(True, topic="kv")
    assert engine_config(build_parser().parse_args(["serve", "--kv-events-config", text])).kv_events_config == expected
    assert engine_config(kserve_args(["--model_name", "m", "--kv-events-config", text])).kv_events_config == expected
    for value in (text, {"enable_kv_cache_events": True, "topic": "kv"}):
        assert AppArgs.model_validate({"kv_events_config": value}).engine_config().kv_events_config == expected


# ---- the wire --------------------------------------------------------------------------------------------------
EVENTS = [BlockStored([H[1], H[2]], H[0], [5, 6, 7, 8, 9, 10, 11, 12], BS), BlockRemoved([H[3], H[4]]),
          AllBlocksCleared(), BlockStored([H[5]], None, [1, 2, 3, 4], BS)]


def test_array_layout_is_vllms_tagged_positional_arrays():
    batch = msgpack.unpackb(encode_batch(1700000000.25, EVENTS, "array", low_64_bits), raw=False)
    ts, events, rank = batch
    assert (ts, rank) == (1700000000.25, 0)
    assert events[0] == ["BlockStored", [low64(H[1]), low64(H[2])], low64(H[0]), [5, 6, 7, 8, 9, 10, 11, 12], BS,
                         None, "GPU", None]
    assert events[1] == ["BlockRemoved", [low64(H[3]), low64(H[4])], "GPU"]
    assert events[2] == ["AllBlocksCleared"]
    assert events[3] == ["BlockStored", [low64(H[5])], None, [1, 2, 3, 4], BS, None, "GPU", None]


def test_map_layout_is_vllms_tagged_maps_in_the_same_batch_array():
    ts, events, rank = msgpack.unpackb(encode_batch(2.5, EVENTS, "map", bytes), raw=False)
    assert (ts, rank) == (2.5, 0)
    assert events[0] == {"type": "BlockStored", "block_hashes": [H[1], H[2]], "parent_block_hash": H[0],
                         "token_ids": [5, 6, 7, 8, 9, 10, 11, 12], "block_size": BS, "lora_id": None,
                         "medium": "GPU", "lora_name": None}
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name"]
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [H[3], H[4]], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_hashes_are_unsigned_64_bit_integers_or_the_digest_itself():
    top = b"\xff" * 32
    raw = encode_batch(0.0, [BlockRemoved([top])], "array", low_64_bits)
    assert b"\xcf" + b"\xff" * 8 in raw  # msgpack uint64, as msgspec writes 2**64 - 1
    assert msgpack.unpackb(raw)[1][0][1] == [2**64 - 1]
    assert msgpack.unpackb(encode_batch(0.0, [BlockRemoved([top])], "array", bytes))[1][0][1] == [top]


# ---- vLLM's block hash -------------------------------------------------------------------------------------------
TOKENS = [0, 1, 23, 24, 255, 256, 65535, 65536, 49151, 2, 3, 4, 5, 6, 7, 8, 100000, 9, 10, 11]  # every CBOR width


def make_request(request_id: str, token_ids: list[int], salt: str | None = None) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=8), 0, 8, frozenset({2}),
                   cache_salt=salt)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_sha256_cbor_hashes_are_vllms(monkeypatch, salt):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    kv = KVCacheManager(16, BS, hash_algo="sha256_cbor")
    request = make_request("a", TOKENS, salt)
    kv.get_computed_blocks(request)  # hashes the prompt's full blocks
    assert request.block_hashes == vllm_block_hashes("sha256_cbor", "1234", TOKENS, BS, salt)
    assert len(request.block_hashes) == 5


def test_sha256_is_vllms_pickled_form_and_the_seed_is_random_without_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    hasher = BlockHasher("sha256")
    seed = hashlib.sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    first = hashlib.sha256(pickle.dumps((seed, (1, 2, 3, 4), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert hasher(None, [1, 2, 3, 4], None) == first
    monkeypatch.delenv("PYTHONHASHSEED")
    assert BlockHasher("sha256_cbor").none_hash != BlockHasher("sha256_cbor").none_hash  # vLLM: os.urandom(32)
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of sha256, sha256_cbor"):
        BlockHasher("xxhash")


# ---- what the KV-cache manager records -------------------------------------------------------------------------
def computed(kv: KVCacheManager, request: Request) -> Request:
    """Allocate and 'compute' the whole prompt of ``request``, publishing its full blocks."""
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return request


def test_the_default_hash_needs_no_cbor2():
    """cbor2 serves sha256_cbor alone: without it the runtime imports and hashes with sha256 (the GPU machines'
    image lacks it), and sha256_cbor names it."""
    code = ("import sys; sys.modules['cbor2'] = None\n"
            "import paged_runtime, paged_runtime.core.kv_cache_manager\n"
            "from paged_runtime.core.block_hash import BlockHasher\n"
            "assert len(BlockHasher('sha256', '0')(None, [1, 2], None)) == 32\n"
            "try:\n    BlockHasher('sha256_cbor', '0')\nexcept ModuleNotFoundError as e:\n    print(e.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (0, "cbor2\n"), out.stderr


def test_stores_evictions_and_a_reset_are_recorded_in_order():
    events = KVEventRecorder(BS)
    kv = KVCacheManager(4, BS, events=events)
    a = computed(kv, make_request("a", range(10)))  # 3 blocks, 2 full
    assert events.take() == [BlockStored(a.block_hashes[:2], None, list(range(8)), BS)]
    a.append_token(10), a.append_token(11)
    assert kv.allocate_slots(a, 2)
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)  # the third block fills up: it chains onto the second
    assert events.take() == [BlockStored([a.block_hashes[2]], a.block_hashes[1], [8, 9, 10, 11], BS)]
    kv.free(a)  # tail first: the free queue is [spare, a2, a1, a0]
    b = computed(kv, make_request("b", range(50, 62)))  # 3 blocks: the spare, then a's last two evicted
    assert events.take() == [BlockRemoved([a.block_hashes[2], a.block_hashes[1]]),
                             BlockStored(b.block_hashes, None, list(range(50, 62)), BS)]
    kv.reset_prefix_cache()
    assert events.take() == [AllBlocksCleared()] and events.take() == []


def test_an_equal_block_already_cached_is_not_stored_twice_and_a_hit_stores_nothing():
    events = KVEventRecorder(BS)
    kv = KVCacheManager(8, BS, events=events)
    computed(kv, make_request("a", range(8)))
    events.take()
    computed(kv, make_request("b", range(8)))  # computed without its hits: the same hashes, already held
    assert events.take() == []


def test_without_a_recorder_nothing_is_recorded():
    kv = KVCacheManager(4, BS)
    assert kv.events is None and kv.pool.events is None
    computed(kv, make_request("a", range(8)))


# ---- the ZMQ publisher -----------------------------------------------------------------------------------------
def endpoints() -> tuple[str, str]:
    name = uuid.uuid4().hex
    return f"inproc://kv-{name}", f"inproc://kv-replay-{name}"


def publisher(event_format: str = "array", registry=None, **config) -> tuple[ZmqEventPublisher, str, str]:
    pub_endpoint, replay_endpoint = endpoints()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_endpoint, replay_endpoint=replay_endpoint,
                            topic="kv@pod@model", **config)
    return make_publisher(config, event_format, "m", registry), pub_endpoint, replay_endpoint


def seq_of(frames: list[bytes]) -> int:
    return int.from_bytes(frames[1], "big")


def synced_subscriber(pub: ZmqEventPublisher, endpoint: str, topic: bytes = b"") -> tuple[object, int]:
    """A SUB socket known to be receiving (a PUB drops what it sends before a subscription reaches it), and the
    next sequence number: probe batches go out until one arrives, then the probes still in flight are read."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    deadline, sent = time.monotonic() + 10, 0
    while not sub.poll(10):
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        pub.publish([AllBlocksCleared()])
        sent += 1
    while seq_of(receive(sub)) != sent - 1:
        pass
    return sub, sent


def test_batches_go_out_as_topic_seq_payload_and_replay_from_a_sequence_number():
    pub, pub_endpoint, replay_endpoint = publisher(buffer_steps=2)
    sub, first = synced_subscriber(pub, pub_endpoint, b"kv@")
    try:
        for i in range(3):
            pub.publish([BlockRemoved([H[i]])])
        for i in range(3):
            topic, seq, payload = receive(sub)
            assert (topic, int.from_bytes(seq, "big")) == (b"kv@pod@model", first + i)
            assert msgpack.unpackb(payload)[1] == [["BlockRemoved", [low64(H[i])], "GPU"]]
        replies = ask_replay(replay_endpoint, 0)  # only the last 2 batches are still buffered
        assert [(int.from_bytes(seq, "big"), msgpack.unpackb(p)[1][0][1]) for seq, p in replies[:-1]] == [
            (first + 1, [low64(H[1])]), (first + 2, [low64(H[2])])]
        assert replies[-1] == [END_SEQ, b""] and int.from_bytes(END_SEQ, "big", signed=True) == -1
        assert ask_replay(replay_endpoint, first + 2)[0][0] == (first + 2).to_bytes(8, "big")
    finally:
        pub.close()
        sub.close(linger=0)


def test_sequence_numbers_start_at_0():
    pub, _, replay_endpoint = publisher()
    try:
        pub.publish([AllBlocksCleared()])
        deadline = time.monotonic() + 10
        while len(replies := ask_replay(replay_endpoint, 0)) < 2:  # sent by the thread in its own time
            assert time.monotonic() < deadline
        assert replies[0][0] == (0).to_bytes(8, "big")
    finally:
        pub.close()


def test_map_format_replays_carry_the_topic_as_vllm_026_does():
    pub, pub_endpoint, replay_endpoint = publisher("map")
    sub, first = synced_subscriber(pub, pub_endpoint)
    try:
        pub.publish([BlockRemoved([H[0]])])
        topic, seq, payload = receive(sub)
        assert msgpack.unpackb(payload)[1] == [{"type": "BlockRemoved", "block_hashes": [low64(H[0])],
                                                "medium": "GPU"}]
        assert ask_replay(replay_endpoint, first) == [[b"kv@pod@model", seq, payload], [b"", END_SEQ, b""]]
    finally:
        pub.close()
        sub.close(linger=0)


def test_a_full_queue_drops_and_counts_without_waiting_and_the_drop_leaves_a_sequence_gap(monkeypatch):
    from prometheus_client import CollectorRegistry
    registry = CollectorRegistry()
    pub, pub_endpoint, replay_endpoint = publisher(registry=registry, max_queue_size=1)
    sub, first = synced_subscriber(pub, pub_endpoint)
    release, sending = threading.Event(), threading.Event()
    real_send = ZmqEventPublisher._send

    def slow_send(self, *args):
        sending.set()
        release.wait(10)
        real_send(self, *args)
    monkeypatch.setattr(ZmqEventPublisher, "_send", slow_send)
    try:
        pub.publish([BlockRemoved([H[0]])])  # first: the sender thread takes it and stalls
        assert sending.wait(5)
        started = time.monotonic()
        pub.publish([BlockRemoved([H[1]])])  # first + 1 fills the queue of one
        pub.publish([BlockRemoved([H[2]])])  # first + 2 is dropped, at once
        assert time.monotonic() - started < 0.5
        assert registry.get_sample_value("vllm:kv_events_dropped_batches_total", {"model_name": "m"}) == 1
        release.set()
        assert [seq_of(receive(sub)) - first for _ in range(2)] == [0, 1]  # the queue is empty again
        pub.publish([BlockRemoved([H[3]])])
        assert seq_of(receive(sub)) - first == 3
        assert [int.from_bytes(s, "big") - first for s, _ in ask_replay(replay_endpoint, first)[:-1]] == [0, 1, 3]
    finally:
        release.set()
        pub.close()
        sub.close(linger=0)


def test_close_sends_what_is_queued_joins_the_thread_and_ignores_later_batches():
    pub, pub_endpoint, _ = publisher()
    sub, first = synced_subscriber(pub, pub_endpoint)
    for i in range(5):
        pub.publish([BlockRemoved([H[i]])])
    pub.close()
    assert not pub._thread.is_alive()
    pub.publish([AllBlocksCleared()])  # ignored
    pub.close()  # idempotent
    assert [seq_of(receive(sub)) - first for _ in range(5)] == [0, 1, 2, 3, 4]
    assert not sub.poll(100)  # (the thread is gone: nothing else can come)
    sub.close(linger=0)


def test_an_endpoint_that_cannot_be_bound_fails_at_construction():
    pub, pub_endpoint, _ = publisher()
    try:
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=pub_endpoint))
    finally:
        pub.close()


def test_vllms_bind_or_connect_rule_and_the_null_publisher():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv") and binds("inproc://kv")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://indexer:5557")
    for config in (None, KVEventsConfig(), KVEventsConfig(enable_kv_cache_events=True, publisher="null")):
        make_publisher(config, "array", "m").publish([AllBlocksCleared()])
