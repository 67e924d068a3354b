"""KV-event routing for Ray Serve (issue 34, item 4): the index the replicas' events build, the router over fake
replicas, the subscriber over a real ZMQ publisher, the replica's token rendering, and a small workload on real
engines where routing by KV events finds at least as many cached blocks as prefix affinity."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ray.serve")

from tests.helpers.serve_fakes import FakeReplica  # noqa: E402
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from paged_runtime.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig,  # noqa: E402
                                          decode_batch, decode_event, encode_batch)
from rayserve_adapter.asgi import ForwardedRequest  # noqa: E402
from rayserve_adapter.kv_router import (KV_BLOCK_SIZE_STAT, KV_EVENTS_ENDPOINT_STAT, KVBlockIndex,  # noqa: E402
                                        KVEventRouter, KVEventSubscriber, chain_keys, topic_of)
from rayserve_adapter.router import PrefixIndex, rank_replicas  # noqa: E402

BS = 4
BLOCK_BYTES = BS * 2 * 2 * 2 * 16 * 4  # the tiny Llama's KV per block in float32: 2 layers, K and V, 2 heads of 16
DEADLINE_S = 30.0


def feed(index: KVBlockIndex, replica: str, *events) -> None:
    """``events`` through the wire and back (array layout, integer hashes), as the subscriber gets them."""
    for event in decode_batch(encode_batch(0.0, events, "array", lambda h: int.from_bytes(h[-8:], "big")))[1]:
        index.apply(replica, *decode_event(event))


def stored(tokens: list[int], first: int = 0, parent: bytes | None = None) -> BlockStored:
    """Blocks of ``tokens`` with made-up hashes: the index must not care how replicas hash."""
    hashes = [bytes([first + i]) * 8 for i in range(len(tokens) // BS)]
    return BlockStored(hashes, parent, tokens, BS)


def test_chain_keys_depend_on_the_whole_prefix():
    a, b = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BS), chain_keys([1, 2, 3, 4, 5, 6, 7, 0], BS)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert chain_keys([9, 9, 9, 9, 5, 6, 7, 8], BS)[1] != a[1]  # same block, other prefix


def test_the_index_follows_stored_removed_and_cleared_blocks():
    index = KVBlockIndex()
    prompt = list(range(100, 112))  # 3 blocks
    feed(index, "a", stored(prompt))
    feed(index, "b", stored(prompt[:8], first=50))  # b hashes its own way: only the tokens matter
    assert index.match(prompt + [7]) == ({"a": 3, "b": 2}, 3)
    feed(index, "a", stored(list(range(112, 116)), first=3, parent=bytes([2]) * 8))  # a chain continued
    assert index.match(list(range(100, 116)))[0] == {"a": 4, "b": 2}
    feed(index, "a", BlockRemoved([bytes([1]) * 8]))  # a evicts its 2nd block: its later ones stop counting
    assert index.match(prompt)[0] == {"a": 1, "b": 2}
    feed(index, "b", AllBlocksCleared())
    assert index.match(prompt)[0] == {"a": 1} and index.num_chunks("b") == 0
    feed(index, "c", stored(list(range(200, 204)), parent=b"\x77" * 8))  # its parent never came: not placed
    assert index.match(list(range(200, 204)))[0] == {}
    index.remove_replicas(["a"])
    assert index.match(prompt) == ({}, 3)


def test_expected_blocks_count_until_their_events_come_or_they_expire():
    index = KVBlockIndex()
    index.block_size = BS
    prompt = list(range(12))
    index.expect("a", prompt)
    assert index.match(prompt)[0] == {"a": 3}
    feed(index, "a", stored(prompt[:4]), BlockRemoved([bytes([0]) * 8]))  # stored, then evicted: gone
    assert index.match(prompt)[0] == {}
    stale = KVBlockIndex(expect_ttl_s=0.0)
    stale.block_size = BS
    stale.expect("a", prompt)
    assert stale.match(prompt)[0] == {}


def pending(tokens: list[int] | None, key: str | None = "k") -> PendingRequest:
    request = ForwardedRequest("POST", "/v1/completions", routing_key=key,
                               routing_tokens=tuple(tokens) if tokens else None)
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


def test_the_router_sends_a_prompt_where_its_blocks_are_and_sheds_a_hot_holder():
    async def scenario():
        router = KVEventRouter(DeploymentID("PagedRuntimeServer", "app"), DeploymentHandleSource.UNKNOWN,
                               use_replica_queue_len_cache=True)
        router.initialize_state(max_imbalance=2)
        a, b = (FakeReplica(name, routing_stats={KV_BLOCK_SIZE_STAT: BS}) for name in "ab")
        router.update_replicas([a, b])
        prompt = list(range(40))

        async def route(tokens):
            request = pending(tokens)
            ranks = await router.choose_replicas([a, b], request)
            router.on_request_routed(request, ranks[0][0].replica_id, None)
            return ranks[0][0].replica_id.unique_id

        first = await route(list(range(900, 940)))
        assert await route(list(range(700, 740))) != first  # a fresh prefix goes where fewer blocks are expected
        router.kv_index.remove_replicas(["a", "b"])
        feed(router.kv_index, "b", stored(prompt[:16]))
        assert await route(prompt) == "b"  # b holds 4 of its 10 blocks
        router.replica_queue_len_cache.update(b.replica_id, 3)  # b is 3 requests busier: beyond max_imbalance
        assert await route(prompt) == "a"
        router.replica_queue_len_cache.update(b.replica_id, 0)
        assert await route(prompt) in ("a", "b")  # both hold it now: a expects it since the last request
        feed(router.kv_index, "b", AllBlocksCleared())
        other = list(range(500, 540))
        first = await route(other)
        assert await route(other) == first  # expected where the first went, before any event
        router.update_replicas([a])  # b is gone: the index forgets it
        assert router.kv_index.num_chunks("b") == 0
        router.subscriber.stop()

    asyncio.run(scenario())


def test_the_subscriber_reads_a_replicas_publisher_over_zmq():
    from paged_runtime.engine.kv_event_publisher import ZmqEventPublisher
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                                                 topic=topic_of("r1")))
    index = KVBlockIndex()
    subscriber = KVEventSubscriber(index)
    try:
        assert publisher.bound_endpoint.startswith("tcp://127.0.0.1:")
        subscriber.follow("r1", publisher.bound_endpoint)
        prompt = list(range(16))
        deadline = time.monotonic() + DEADLINE_S
        while index.match(prompt)[0] != {"r1": 4}:  # a PUB drops what it sends before the SUB has joined
            assert time.monotonic() < deadline, "no event reached the index"
            publisher.publish([stored(prompt)])
            time.sleep(0.05)
    finally:
        subscriber.stop()
        publisher.close()


def test_the_ingress_renders_the_token_ids_the_replica_will_run(tiny_llama_dir):
    """The ingress's renderer, built from what a replica hands over, gives exactly the replica's /render ids."""
    import json

    import httpx

    from rayserve_adapter.deployment import EngineReplica
    from rayserve_adapter.render import PromptRenderer
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if tools %}[tools]{% endif %}"
    replica = EngineReplica({"model": str(tiny_llama_dir), "served_model_name": "tiny", "dtype": "float32",
                             "max_model_len": 256, "kv_cache_memory": 4 * 2**20, "num_replicas": 2,
                             "chat_template": template})
    try:
        endpoint = replica.record_routing_stats()[KV_EVENTS_ENDPOINT_STAT]  # kv_events routing: a port of its own,
        assert endpoint == replica.engine.kv_events_endpoint and endpoint.startswith("tcp://127.0.0.1:")  # the node's
        renderer = PromptRenderer(*replica.render_spec())
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        bodies = [("/v1/completions", {"prompt": "hello there"}), ("/v1/completions", {"prompt": [5, 6, 7]}),
                  ("/v1/completions", {"prompt": ["first one", "second"]}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                            "tool_choice": "none"}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                                                         {"role": "assistant", "content": "b"}],
                                            "add_generation_prompt": False, "continue_final_message": True})]

        async def compare():
            transport = httpx.ASGITransport(app=replica.asgi_app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                for path, body in bodies:
                    response = await client.post(path + "/render", json=body)
                    assert response.status_code == 200, (body, response.text)
                    rendered = response.json()
                    first = rendered[0] if isinstance(rendered, list) else rendered
                    assert await renderer.tokens(path, json.dumps(body).encode()) == tuple(first["token_ids"]), body
                for path, raw in [("/v1/completions", b'{"prompt": 5}'), ("/v1/chat/completions", b"[1]"),
                                  ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')]:
                    assert await renderer.tokens(path, raw) is None, raw  # the replica will answer these

        asyncio.run(compare())
    finally:
        replica.shutdown()


# ---- KV events against prefix affinity, on real engines --------------------------------------------------------
class Capture:
    """Stands in for an engine core's publisher: its batches go through the wire format into ``index``."""
    bound_endpoint = None

    def __init__(self, index: KVBlockIndex, replica: str) -> None:
        self.index, self.replica = index, replica

    def publish(self, events) -> None:
        feed(self.index, self.replica, *events)

    def close(self) -> None:
        pass


def conversations() -> list[list[int]]:
    """Multi-turn chats under two shared system prompts, interleaved: each turn's prompt is the whole history."""
    systems = [list(range(1000, 1032)), list(range(2000, 2032))]
    turns = []
    for turn in range(3):
        for chat in range(6):
            history = systems[chat % 2] + [3000 + 100 * chat + t for t in range((turn + 1) * 12)]
            turns.append(history)
    return turns


def run_workload(engines, choose) -> int:
    """Every prompt on the engine ``choose`` picks (one at a time); the prefix-cache hits, in tokens."""
    from paged_runtime import SamplingParams
    before = sum(e.stats().num_prefix_hits for e in engines)
    for i, prompt in enumerate(conversations()):
        engine = engines[choose(prompt)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    return sum(e.stats().num_prefix_hits for e in engines) - before


@pytest.mark.slow
def test_routing_by_kv_events_finds_at_least_what_prefix_affinity_finds(tiny_llama_dir):
    """Two engines whose caches hold about half the workload's blocks each (so they evict): the KV-event router
    knows what each still holds; prefix affinity remembers only what it sent where."""
    from paged_runtime.config import EngineConfig
    from paged_runtime.engine.llm_engine import LLMEngine
    hits = {}
    for router in ("prefix", "kv_events"):
        index, text_index = KVBlockIndex(), PrefixIndex(chunk_chars=16)
        engines = []
        for name in ("a", "b"):
            engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=96,
                                            block_size=BS, kv_cache_memory=24 * BLOCK_BYTES, max_num_seqs=1,
                                            kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                                              "endpoint": f"inproc://kv-{router}-{name}"}))
            engine.core.kv_event_publisher.close()
            engine.core.kv_event_publisher = Capture(index, name)
            engines.append(engine)

        def choose(prompt: list[int]) -> int:
            if router == "kv_events":
                depths, blocks = index.match(prompt)
                ranks = rank_replicas(["a", "b"], {"a": 0, "b": 0}, depths, blocks, {}, index,
                                      min_match_ratio=0.1, max_imbalance=4)
            else:
                key = " ".join(map(str, prompt))
                depths, chunks = text_index.match(key)
                ranks = rank_replicas(["a", "b"], {"a": 0, "b": 0}, depths, chunks, {}, text_index,
                                      min_match_ratio=0.1, max_imbalance=4)
                text_index.insert(key, ranks[0][0])
            return "ab".index(ranks[0][0])

        hits[router] = run_workload(engines, choose)
        assert all(e.core.num_blocks == 24 for e in engines)  # ~half the workload's 70 distinct blocks each
        for engine in engines:
            engine.shutdown()
    print(f"prefix-cache hits (tokens): {hits}")
    assert hits["kv_events"] >= hits["prefix"] > 0
