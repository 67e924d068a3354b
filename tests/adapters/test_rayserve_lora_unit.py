"""LoRA on Ray Serve without a cluster: how the ingress reads a request's ``model`` (base, adapter, ``base:adapter``,
malformed), the adapters it lists from the dynamic folder, what a replica reports holding, and multiplexed
routing: ``rank_replicas`` with holders, the routers on fake replicas, prefixes and KV blocks kept per adapter."""
from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

pytest.importorskip("ray.serve")

from tests.helpers.serve_fakes import FakeReplica  # noqa: E402
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from paged_runtime.core.kv_events import BlockStored, decode_batch, decode_event, encode_batch  # noqa: E402
from rayserve_adapter import app  # noqa: E402
from rayserve_adapter.asgi import ForwardedRequest, ResponseStart  # noqa: E402
from rayserve_adapter.kv_router import KV_BLOCK_SIZE_STAT, KVBlockIndex, KVEventRouter  # noqa: E402
from rayserve_adapter.lora import (LORA_ADAPTERS_STAT, MAX_NAME_CHARS, AdapterNames, AdapterPlacement,  # noqa: E402
                                   chain_root, holders_of, unique_by_id)
from rayserve_adapter.router import PrefixAffinityRouter, PrefixIndex, rank_replicas  # noqa: E402

JSON = ((b"content-type", b"application/json"),)
NAMES = AdapterNames(("alpha", "beta"), None)


# ---- the ingress's reading of ``model`` ------------------------------------------------------------------
@pytest.mark.parametrize("model,base,adapter", [
    ("alpha", "alpha", None),
    ("beta", "beta", None),
    ("sql", None, "sql"),  # an adapter named alone: the first model's replica decides
    ("beta:sql", "beta", "sql"),
    ("alpha:", None, "alpha:"),  # no adapter after the separator: no base either
    ("gamma:sql", None, "gamma:sql"),  # not a served base: the whole name (no replica holds it)
    ("a:b:c", None, "a:b:c"),
    ("beta:a:b", "beta", "a:b"),
    ("x\ud800y", None, None),  # a lone surrogate: never an adapter name (the router hashes names)
    ("beta:\udfff", "beta", None),
    ("x" * (MAX_NAME_CHARS + 1), None, None),
])
def test_the_ingress_tells_base_models_from_adapters(model, base, adapter):
    assert NAMES.base_of(model) == base
    assert NAMES.adapter_of(model) == adapter


def test_no_model_is_no_adapter():
    assert NAMES.adapter_of(None) is None and NAMES.adapter_of("") is None


def test_the_dynamic_folder_lists_the_adapters_a_request_would_load(tmp_path):
    for name in ("sql", "chat", "beta", "back\\slash", "no-config"):
        (tmp_path / name).mkdir()
        if name != "no-config":
            (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "file.json").write_text("{}")
    os.mkdir(os.fsencode(tmp_path) + b"/bad\xff")  # not UTF-8: comes back with a lone surrogate
    (tmp_path / os.fsdecode(b"bad\xff") / "adapter_config.json").write_text("{}")
    names = AdapterNames(("alpha", "beta"), str(tmp_path))
    entries = names.folder_entries(123)
    assert [e["id"] for e in entries] == ["chat", "sql"]  # a base's name, no config, unlistable: not adapters
    assert entries[1] == {"id": "sql", "object": "model", "created": 123, "owned_by": "paged-runtime",
                          "root": str(tmp_path / "sql"), "parent": "alpha", "max_model_len": None}
    json.dumps(entries).encode()  # every entry can go out as JSON
    assert AdapterNames(("alpha",), str(tmp_path / "missing")).folder_entries(0) == []
    assert NAMES.folder_entries(0) == []


def test_listings_keep_the_first_entry_of_each_id():
    entries = [{"id": "alpha"}, {"id": "sql", "parent": "alpha"}, {"id": "sql", "parent": "beta"}, {"id": "x"}]
    assert unique_by_id(entries) == [{"id": "alpha"}, {"id": "sql", "parent": "alpha"}, {"id": "x"}]


# ---- what a replica holds ----------------------------------------------------------------------------------
class FakeEngine:
    model_root = "/m"

    def __init__(self) -> None:
        self.calls = []

    async def add_lora(self, request) -> None:
        if request.lora_name == "broken":
            raise ValueError("cannot run")
        self.calls.append(("add", request.lora_int_id))

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove", lora_id))
        return True


def test_a_replica_reports_the_adapters_its_engine_read_until_they_are_unloaded():
    from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
    engine = FakeEngine()
    adapters = LoRAAdapters(["tiny"], enabled=True)

    async def scenario():
        await adapters.load(engine, "sql", "/a/sql")
        await adapters.load(engine, "chat", "/a/chat")
        with pytest.raises(ValueError):
            await adapters.load(engine, "broken", "/a/broken")  # never read: never held
        assert adapters.read_by(engine) == ["chat", "sql"]
        await adapters.unload(lambda base: engine, "sql")
        assert adapters.read_by(engine) == ["chat"]
        assert adapters.read_by(FakeEngine()) == []  # another replica's engine read nothing

    asyncio.run(scenario())
    assert engine.calls == [("add", 1), ("add", 2), ("remove", 1)]


# ---- multiplexed routing -------------------------------------------------------------------------------------
def test_rank_prefers_a_warm_holder_of_the_adapter():
    index = PrefixIndex(chunk_chars=4)

    def rank(loads, holders, depths=None, n=4):
        return rank_replicas(list(loads), loads, depths or {}, n, {}, index, min_match_ratio=0.1, max_imbalance=4,
                             holders=holders)

    assert rank({"A": 0, "B": 0}, {"B"}) == [["B"], ["A"]]
    assert rank({"A": 0, "B": 4}, {"B"}) == [["B"], ["A"]]  # 4 busier: still warm
    assert rank({"A": 0, "B": 5}, {"B"}) == [["A"], ["B"]]  # hot: the ranking without an adapter
    assert rank({"A": 0, "B": 2, "C": 1}, {"B", "C"}) == [["C"], ["B"], ["A"]]  # the least loaded holder first
    assert rank({"A": 0, "B": 1, "C": 2}, {"B", "C"}, {"C": 3}) == [["C"], ["B"], ["A"]]  # its prefix owner
    assert rank({"A": 0, "B": 6, "C": 2}, {"B", "C"}) == [["C"], ["A", "B"]]  # B is hot: no warm rank for it
    assert rank({"A": 0, "B": 0}, {"A", "B"}, {"A": 1}) == [["A"], ["B"]]
    assert rank({"A": 1, "B": 0}, set()) == [["B"], ["A"]]  # no adapter: as before
    assert rank({"A": 0, "B": 0}, {"gone"}) == rank({"A": 0, "B": 0}, set())  # a holder not among the candidates


def test_holders_are_reported_or_sent_lately():
    stats = {"a": {LORA_ADAPTERS_STAT: ["sql"]}, "b": {LORA_ADAPTERS_STAT: "sql"}, "c": None, "d": {}}
    assert holders_of("sql", stats) == {"a"}  # a malformed report holds nothing
    assert holders_of("sql", stats, ["d"]) == {"a", "d"}
    assert holders_of(None, stats, ["d"]) == set()
    placement = AdapterPlacement(ttl_s=5, max_names=2)
    placement.sent("sql", "a", now=0)
    placement.sent("sql", "b", now=3)
    assert placement.recent("sql", now=4) == {"a", "b"}
    assert placement.recent("sql", now=6) == {"b"}  # a's entry expired
    placement.sent("chat", "a", now=6)
    placement.sent("mlp", "a", now=6)  # a third name: the least recently sent ("sql") goes
    assert placement.recent("sql", now=6) == set() and placement.recent("chat", now=6) == {"a"}
    placement.remove_replicas(["a"])
    assert placement.recent("chat", now=6) == set() and placement.recent("mlp", now=6) == set()


def test_prefixes_and_kv_blocks_are_kept_per_adapter():
    assert chain_root(None, b"root") == b"root" and chain_root("sql", b"root") != chain_root("chat", b"root")
    assert chain_root("\ud800", b"") != b""  # a name the ingress would never pass still hashes
    index = PrefixIndex(chunk_chars=4)
    index.insert("aaaabbbb", "A", "sql")
    index.insert("aaaabbbb", "B")
    assert index.match("aaaabbbbcccc", "sql") == ({"A": 2}, 3)
    assert index.match("aaaabbbbcccc") == ({"B": 2}, 3)
    assert index.match("aaaabbbb", "chat") == ({}, 2)

    kv = KVBlockIndex()
    tokens = list(range(8))
    event = BlockStored([b"\x01" * 8, b"\x02" * 8], None, tokens, 4, 7, "sql")  # as the engine sends it
    for wire in decode_batch(encode_batch(0.0, [event], "array", lambda h: int.from_bytes(h, "big")))[1]:
        kv.apply("a", *decode_event(wire))
    assert kv.match(tokens, "sql") == ({"a": 2}, 2)
    assert kv.match(tokens) == ({}, 2) and kv.match(tokens, "chat") == ({}, 2)
    kv.expect("b", tokens, "chat")
    assert kv.match(tokens, "chat") == ({"b": 2}, 2)


def pending(key: str | None, adapter: str | None, tokens: list[int] | None = None) -> PendingRequest:
    request = ForwardedRequest("POST", "/v1/completions", routing_key=key, lora_name=adapter,
                               routing_tokens=tuple(tokens) if tokens else None)
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r"))


@pytest.mark.parametrize("router_class", [PrefixAffinityRouter, KVEventRouter])
def test_the_routers_send_an_adapter_to_its_holders_until_they_are_hot(router_class):
    prompts = [f"{i}: which of these sentences is the longest one? " * 3 for i in range(6)]  # none shares a block

    async def scenario():
        router = router_class(DeploymentID("PagedRuntimeServer", "app"), DeploymentHandleSource.UNKNOWN,
                              use_replica_queue_len_cache=True)
        router.initialize_state(max_imbalance=2)
        a, b = (FakeReplica(name, routing_stats={KV_BLOCK_SIZE_STAT: 4}) for name in "ab")
        router.update_replicas([a, b])

        async def route(prompt: str | None, adapter: str | None) -> list[list[str]]:
            tokens = [ord(c) for c in prompt] if prompt and router_class is KVEventRouter else None
            request = pending(prompt, adapter, tokens)
            ranks = await router.choose_replicas([a, b], request)
            router.on_request_routed(request, ranks[0][0].replica_id, None)
            return [[r.replica_id.unique_id for r in rank] for rank in ranks]

        first = (await route(prompts[0], "sql"))[0][0]
        for prompt in prompts[1:4]:  # fresh prompts would spread; the adapter keeps them where it is loaded
            assert (await route(prompt, "sql"))[0] == [first]
        assert (await route(None, "sql"))[0] == [first]  # no prompt to match: the adapter alone routes it
        other = "b" if first == "a" else "a"
        (b if other == "b" else a).routing_stats[LORA_ADAPTERS_STAT] = ["chat"]  # reported in its stats
        assert (await route(prompts[4], "chat"))[0] == [other]
        router.replica_queue_len_cache.update((a if first == "a" else b).replica_id, 3)  # beyond max_imbalance
        assert await route(prompts[5], "sql") == [[other], [first]]
        kept = a if other == "a" else b
        router.update_replicas([kept])  # the first holder is gone, and where the router sent it with it
        assert router.placement.recent("sql") == {kept.replica_id}
        if router_class is KVEventRouter:
            router.subscriber.stop()

    asyncio.run(scenario())


# ---- the ingress ---------------------------------------------------------------------------------------------
class RecordingHandle:
    """A model deployment's handle that answers every request with ``body`` and keeps what it was sent."""

    def __init__(self, body: dict) -> None:
        self.body, self.sent = body, []
        self.forward = self

    def options(self, **kwargs):
        return self

    def remote(self, request: ForwardedRequest):
        self.sent.append(request)

        async def parts():
            yield ResponseStart(200, JSON)
            yield json.dumps(self.body).encode()
        return parts()

    def cancel(self) -> None:
        pass


def listing(*entries: dict) -> dict:
    return {"object": "list", "data": list(entries)}


def call(ingress, method: str, path: str, content: bytes = b"") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=ingress.__serve_build_asgi_app__())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, content=content, headers={"content-type": "application/json"})
    return asyncio.run(go())


def test_the_ingress_routes_adapters_to_their_base_and_names_them_for_the_router(tmp_path):
    (tmp_path / "sql" / "adapter_config.json").parent.mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    alpha = RecordingHandle(listing({"id": "alpha"}, {"id": "chat", "parent": "alpha"}))
    beta = RecordingHandle(listing({"id": "beta"}, {"id": "chat", "parent": "beta"}))
    from rayserve_adapter.deployment import OpenAIIngress
    ingress = OpenAIIngress({"alpha": alpha, "beta": beta}, lora=AdapterNames(("alpha", "beta"), str(tmp_path)))
    cases = [(b'{"model": "beta:sql", "prompt": "hi"}', beta, "sql"),
             (b'{"model": "sql", "prompt": "hi"}', alpha, "sql"),
             (b'{"model": "gamma", "prompt": "hi"}', alpha, "gamma"),  # the replica answers 404, not the ingress
             (b'{"model": "beta", "prompt": "hi"}', beta, None),
             (b'{"model": "x\\ud800", "prompt": "hi"}', alpha, None),  # a lone surrogate: the replica's 400
             (b'{"model": "beta:\\udfff", "prompt": "hi"}', beta, None),
             (b"not json", alpha, None)]
    for body, handle, adapter in cases:
        assert call(ingress, "POST", "/v1/completions", body).status_code == 200, body
        assert handle.sent[-1].lora_name == adapter and handle.sent[-1].body == body, body
    assert handle.sent[-1].routing_key is None
    assert beta.sent[0].routing_key == "hi"
    models = call(ingress, "GET", "/v1/models").json()["data"]
    assert models == [{"id": "alpha"}, {"id": "chat", "parent": "alpha"}, {"id": "beta"},
                      {"id": "sql", "object": "model", "created": ingress.created, "owned_by": "paged-runtime",
                       "root": str(tmp_path / "sql"), "parent": "alpha", "max_model_len": None}]


def test_one_models_ingress_names_adapters_and_lists_the_folder(tmp_path):
    from rayserve_adapter.deployment import OpenAIIngress
    model = RecordingHandle(listing({"id": "tiny"}))
    plain = OpenAIIngress(model)  # without LoRA the ingress leaves ``model`` to the replica
    call(plain, "POST", "/v1/completions", b'{"model": "sql", "prompt": "hi"}')
    assert model.sent[-1].lora_name is None and model.sent[-1].routing_key == "hi"
    ingress = OpenAIIngress(model, lora=AdapterNames(("tiny",), str(tmp_path)))
    for requested, adapter in (("sql", "sql"), ("tiny:sql", "sql"), ("tiny", None)):
        call(ingress, "POST", "/v1/chat/completions",
             json.dumps({"model": requested, "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert model.sent[-1].lora_name == adapter and model.sent[-1].routing_key == "user: hi"
    assert call(ingress, "GET", "/v1/models").json()["data"] == [{"id": "tiny"}]  # an empty folder


def test_the_builder_tells_the_ingress_about_lora():
    args = {"model": "/m", "served_model_name": ["tiny", "alias"], "num_replicas": 2}
    ingress = app({**args, "enable_lora": True, "dynamic_lora_loading_path": "/adapters"})._bound_deployment
    assert ingress.init_kwargs["lora"] == AdapterNames(("tiny", "alias"), "/adapters")
    assert app(args)._bound_deployment.init_kwargs["lora"] is None


def test_the_serve_configs_lora_example_builds():
    """manifests/rayserve/serve-config.yaml's commented LoRA arguments, switched on, make a valid application."""
    import re
    from pathlib import Path
    yaml = pytest.importorskip("yaml")
    text = (Path(__file__).resolve().parents[2] / "manifests" / "rayserve" / "serve-config.yaml").read_text()
    lora = {k: yaml.safe_load(v) for k, v in re.findall(r"^ +# ((?:enable|max|dynamic)_lora\w*): (\S+)", text, re.M)}
    assert set(lora) == {"enable_lora", "dynamic_lora_loading_path", "max_loras", "max_lora_rank"}
    args = {**yaml.safe_load(text)["applications"][0]["args"], **lora, "num_replicas": 2}
    ingress = app(args)._bound_deployment
    assert ingress.init_kwargs["lora"].dynamic_path == lora["dynamic_lora_loading_path"]
    assert ingress.init_args[0]._bound_deployment.init_args[0].engine_config().lora_config.max_loras == 4
