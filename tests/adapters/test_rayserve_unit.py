"""rayserve_adapter without a Ray cluster: arguments, deployment options, the autoscaling policy on synthetic
stats, the prefix-aware router on fake replicas, and the model replica driven in-process.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from tests.helpers.serve_fakes import FakeReplica  # noqa: E402
from ray.serve.config import AutoscalingConfig, AutoscalingContext  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from rayserve_adapter import AppArgs, app  # noqa: E402
from rayserve_adapter.asgi import ForwardedRequest, ResponseStart  # noqa: E402
from rayserve_adapter.autoscaling import KV_CACHE_USAGE, NUM_WAITING, POLICY_PATH, EngineAutoscalingPolicy  # noqa: E402
from rayserve_adapter.builder import KV_ROUTER_PATH, ROUTER_PATH, ingress_options, model_options, placement_options  # noqa: E402,E501
from rayserve_adapter.router import (MAX_KEY_CHARS, PrefixAffinityRouter, PrefixIndex, rank_replicas,  # noqa: E402
                                     routing_key)

JSON = ((b"content-type", b"application/json"),)


# ---- arguments and deployment options ------------------------------------------------------------
def test_args_defaults_and_cli_strings():
    args = AppArgs.model_validate({})
    assert args.model is None and args.max_num_seqs == 256 and args.num_replicas == 1
    assert args.served_model_names == ["SmolLM2-135M-Instruct"]
    from paged_runtime.models.default_model import DEFAULT_MODEL_NAME
    assert args.served_model_names == [DEFAULT_MODEL_NAME]  # the copy kept to stay torch-free is in step
    # `serve run rayserve_adapter:app max_num_seqs=64 ...` passes strings
    args = AppArgs.model_validate({"model": "/m", "max_num_seqs": "64", "enable_prefix_caching": "false",
                                   "kv_cache_memory": "512MiB", "num_replicas": "2"})
    assert (args.max_num_seqs, args.enable_prefix_caching, args.kv_cache_memory, args.num_replicas) == (
        64, False, 512 * 2**20, 2)
    assert args.served_model_names == ["/m"] and args.replica_max_ongoing_requests == 64


def test_serve_validates_command_line_args_into_app_args():
    """What `serve run rayserve_adapter:app max_num_seqs=64 ...` does with its key=value strings."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    built = call_user_app_builder_with_args_if_necessary(app, {"max_num_seqs": "64", "num_replicas": "2"})
    assert built._bound_deployment.init_args[0]._bound_deployment.max_ongoing_requests == 64
    with pytest.raises(ValueError, match="max_num_sqes"):
        call_user_app_builder_with_args_if_necessary(app, {"max_num_sqes": "64"})


def test_args_map_onto_engine_config_by_name():
    args = AppArgs.model_validate({"model": "/m", "served_model_name": "x", "dtype": "float32", "max_model_len": 512,
                                   "max_num_seqs": 8, "max_num_batched_tokens": 1024, "block_size": 32,
                                   "kv_cache_memory": 4096, "gpu_memory_utilization": 0.5, "seed": 7,
                                   "enable_prefix_caching": False, "scheduling_policy": "priority"})
    config = args.engine_config()
    for name in ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "kv_cache_memory", "gpu_memory_utilization", "seed", "enable_prefix_caching", "scheduling_policy"):
        assert getattr(config, name) == getattr(args, name), name
    assert config.served_model_name == ["x"]
    spec = AppArgs.model_validate({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'})
    assert spec.engine_config().speculative_config.num_speculative_tokens == 3


@pytest.mark.parametrize("bad,field", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_sqes": 8}, "max_num_sqes"),  # a typo is refused, not ignored
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"max_queued_requests": 0}, "max_queued_requests"),
    ({"dtype": "int8"}, "dtype"),
])
def test_bad_args_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        AppArgs.model_validate(bad)


def test_args_refuse_replicas_with_autoscaling():
    with pytest.raises(ValueError, match="either num_replicas or autoscaling_config"):
        AppArgs.model_validate({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}})


def test_single_replica_app_is_one_deployment_sized_by_the_engine():
    args = {"max_num_seqs": "48", "max_queued_requests": 10, "retry_after_s": 3, "num_cpus": 0}
    deployment = app(args)._bound_deployment
    assert deployment.name == "PagedRuntimeServer" and deployment.num_replicas == 1
    assert deployment.max_ongoing_requests == 48  # Serve's default of 5 would starve the batch
    assert deployment.max_queued_requests == 10
    assert (deployment.backpressure_config.status_code, deployment.backpressure_config.retry_after_s) == (429, 3)
    assert deployment.ray_actor_options["num_cpus"] == 0
    assert isinstance(deployment.init_args[0], AppArgs)


def test_multi_replica_app_is_an_ingress_over_prefix_routed_replicas():
    ingress = app({"num_replicas": 3, "max_num_seqs": 8, "max_queued_requests": 5})._bound_deployment
    assert ingress.name == "PagedRuntimeIngress" and ingress.num_replicas == 1
    assert ingress.max_ongoing_requests == 8 * 3 + 5 + 64
    model = ingress.init_args[0]._bound_deployment
    assert model.name == "PagedRuntimeServer" and model.num_replicas == 3 and model.max_ongoing_requests == 8
    router = model._deployment_config.request_router_config
    assert router.request_router_class == KV_ROUTER_PATH
    assert router.get_request_router_class().__name__ == "KVEventRouter"  # importable, pickled by value
    assert ingress.init_args[2] is True  # the ingress renders each prompt's tokens for the router
    prefix = app({"num_replicas": 2, "request_router": "prefix"})._bound_deployment
    config = prefix.init_args[0]._bound_deployment._deployment_config.request_router_config
    assert config.request_router_class == ROUTER_PATH and config.get_request_router_class().__name__ == \
        "PrefixAffinityRouter"
    assert prefix.init_args[2] is False
    plain = app({"num_replicas": 2, "request_router": "power_of_two"})._bound_deployment.init_args[0]._bound_deployment
    assert plain._deployment_config.request_router_config.is_default_request_router()


def test_autoscaling_uses_the_engine_policy_unless_told_otherwise():
    options = model_options(AppArgs.model_validate({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}))
    assert "num_replicas" not in options
    assert options["autoscaling_config"]["policy"] == {"policy_function": POLICY_PATH}
    config = AutoscalingConfig(**options["autoscaling_config"])
    assert config.policy.get_policy() .__name__ == "EngineAutoscalingPolicy"
    own = {"policy": {"policy_function": "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"},
           "max_replicas": 2}
    assert model_options(AppArgs.model_validate({"autoscaling_config": own}))["autoscaling_config"]["policy"] == \
        own["policy"]
    ingress = ingress_options(AppArgs.model_validate({"autoscaling_config": {"max_replicas": 4}, "max_num_seqs": 2}))
    assert ingress["max_ongoing_requests"] == 2 * 4 + 64


def placement(**args) -> dict:
    return placement_options(AppArgs.model_validate(args))


def test_gpu_placement():
    assert placement(num_cpus=1) == {"ray_actor_options": {"num_cpus": 1}}
    assert placement(num_cpus=2, num_gpus=1) == {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1}}
    gpu = app({"num_gpus": 1})._bound_deployment
    assert gpu.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_parallel_replica_has_one_bundle_per_rank_on_one_node():
    """Bundle i is rank i's; the replica sits in bundle 0 with its CPUs only (rank 0 takes that GPU)."""
    assert placement(num_cpus=2, tensor_parallel_size=4) == {
        "ray_actor_options": {"num_cpus": 2},
        "placement_group_bundles": [{"GPU": 1, "CPU": 2}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}],
        "placement_group_strategy": "STRICT_PACK"}
    deployment = app({"tensor_parallel_size": 2, "num_cpus": 0})._bound_deployment
    assert deployment.ray_actor_options == {"num_cpus": 0.0}  # no GPU: the replica's process only schedules
    replica = deployment._replica_config
    assert (replica.placement_group_bundles, replica.placement_group_strategy) == ([{"GPU": 1}, {"GPU": 1}],
                                                                                   "STRICT_PACK")


def test_pipeline_stages_may_span_nodes():
    options = placement(num_cpus=1, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert options["placement_group_bundles"] == [{"GPU": 1, "CPU": 1}] + [{"GPU": 1}] * 3
    assert options["placement_group_strategy"] == "PACK"
    assert placement(tensor_parallel_size=2, pipeline_parallel_size=2,
                     placement_strategy="STRICT_PACK")["placement_group_strategy"] == "STRICT_PACK"
    assert placement(num_cpus=1, device="cpu", tensor_parallel_size=2)["placement_group_bundles"] == [
        {"CPU": 2}, {"CPU": 1}]  # a CPU rank reserves a core


def test_parallel_args_reach_the_engine_as_ray_ranks():
    config = AppArgs.model_validate({"tensor_parallel_size": "2", "pipeline_parallel_size": "2"}).engine_config()
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.distributed_executor_backend,
            config.device) == (2, 2, "ray", "cuda")  # the replica holds no GPU: "auto" would mean its CPU
    cpu = AppArgs.model_validate({"tensor_parallel_size": 2, "device": "cpu"}).engine_config()
    assert (cpu.device, cpu.distributed_executor_backend) == ("cpu", "ray")
    one = AppArgs.model_validate({}).engine_config()
    assert (one.device, one.distributed_executor_backend) == ("auto", None)


# ---- the autoscaling policy ---------------------------------------------------------------------------
def context(num_replicas: int, waiting: list[float] | None, kv: list[float] | None, queued: float = 0.0,
            num_requests: float = 0.0) -> AutoscalingContext:
    replicas = [ReplicaID(f"r{i}", DeploymentID("PagedRuntimeServer", "app")) for i in range(num_replicas)]
    metrics = {}
    if waiting is not None:
        metrics[NUM_WAITING] = dict(zip(replicas, waiting))
    if kv is not None:
        metrics[KV_CACHE_USAGE] = dict(zip(replicas, kv))
    return AutoscalingContext(
        deployment_id=DeploymentID("PagedRuntimeServer", "app"), deployment_name="PagedRuntimeServer",
        app_name="app", current_num_replicas=num_replicas, target_num_replicas=num_replicas,
        running_replicas=replicas, total_num_requests=num_requests, total_queued_requests=queued,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=10, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=time.time(), config=AutoscalingConfig(min_replicas=1, max_replicas=10))


@pytest.mark.parametrize("ctx,expected", [
    (context(2, [3, 5], [0.3, 0.3]), 4),  # 8 waiting / (2 replicas * 2 per replica) = pressure 2
    (context(2, [0, 0], [0.5, 0.5], queued=6), 3),  # requests queued at Serve's handles wait too
    (context(2, [0, 0], [0.95, 0.85]), 3),  # KV pressure: mean 0.9 / 0.8 -> ceil(2 * 1.125)
    (context(3, [0, 0, 0], [0.0, 0.1, 0.05]), 2),  # idle: one replica fewer per decision
    (context(1, [0], [0.0]), 0),  # idle at one replica: down to zero if min_replicas allows (Serve bounds it)
    (context(2, [1, 0], [0.5, 0.5]), 2),  # busy but under target: hold
    (context(2, None, None), 2),  # no reports yet: no evidence, hold
    (context(2, [0, 0], [0.1, 0.1], num_requests=500), 1),  # many requests, none waiting: counts do not scale
])
def test_policy_scales_on_waiting_and_kv_usage(ctx, expected):
    desired, state = EngineAutoscalingPolicy()(ctx)
    assert desired == expected
    assert isinstance(state, dict)


def test_policy_cold_start_and_kwargs():
    assert EngineAutoscalingPolicy()(context(0, [], []))[0] == 0  # Serve's own path scales up from zero
    strict = EngineAutoscalingPolicy(target_num_waiting_per_replica=1, target_kv_cache_usage=0.5)
    assert strict(context(2, [1, 2], [0.2, 0.2]))[0] == 3
    with pytest.raises(ValueError):
        EngineAutoscalingPolicy(target_kv_cache_usage=0.5, idle_kv_cache_usage=0.6)
    # As Serve's controller gets it: from the import path, pickled by value, built with policy_kwargs.
    config = AutoscalingConfig(policy={"policy_function": POLICY_PATH,
                                       "policy_kwargs": {"target_num_waiting_per_replica": 4}}, max_replicas=4)
    policy = config.policy.get_policy()(**config.policy.policy_kwargs)
    assert policy(context(2, [4, 4], [0.1, 0.1]))[0] == 2 and policy(context(2, [8, 4], [0.1, 0.1]))[0] == 3


# ---- prefix-aware routing -------------------------------------------------------------------------------
def test_prefix_index_matches_whole_chunks_and_forgets_lru():
    index = PrefixIndex(chunk_chars=4, max_chunks=6)
    index.insert("aaaabbbbcc", "A")  # two whole chunks; "cc" is ignored
    index.insert("aaaaxxxx", "B")
    assert index.match("aaaabbbbdddd") == ({"A": 2, "B": 1}, 3)
    assert index.match("zzzzaaaa") == ({}, 2)  # chunks chain: a later chunk alone is no match
    assert (index.num_chunks("A"), index.num_chunks("B")) == (2, 2)
    index.insert("qqqqrrrrssss", "B")  # 3 more hashes -> 6: at the bound
    index.insert("tttt", "A")  # the 7th evicts the least recently used ("aaaaxxxx"'s second chunk)
    assert index.match("aaaaxxxx") == ({"A": 1, "B": 1}, 2)
    index.remove_replicas(["B"])
    assert index.match("qqqq")[0] == {} and index.num_chunks("B") == 0


def test_rank_prefers_the_owner_until_it_is_hot():
    index = PrefixIndex(chunk_chars=4)
    loads, kv = {"A": 0, "B": 0}, {}
    rank = lambda loads, depths, n=4: rank_replicas(["A", "B"], loads, depths, n, kv, index, min_match_ratio=0.1,
                                                    max_imbalance=4)
    assert rank(loads, {"B": 3}) == [["B"], ["A"]]
    assert rank({"A": 0, "B": 4}, {"B": 3}) == [["B"], ["A"]]  # 4 more than the least loaded: still the owner
    assert rank({"A": 0, "B": 5}, {"B": 3}) == [["A"], ["B"]]  # hot: least loaded
    assert rank({"A": 2, "B": 1}, {}) == [["B"], ["A"]]  # no match: least loaded
    assert rank(loads, {"B": 1}, n=20) == [["A"], ["B"]]  # a 5% match is no match (min_match_ratio 0.1)
    assert rank_replicas(["A", "B"], loads, {}, 4, {"A": 0.3, "B": 0.0}, index, min_match_ratio=0.1,
                         max_imbalance=4) == [["B"], ["A"]]  # idle tie, no prefixes anywhere: more free KV
    index.insert("aaaabbbb", "A")
    assert rank(loads, {}) == [["B"], ["A"]]  # idle tie: the replica holding fewer prefixes
    assert rank_replicas(["A", "B"], loads, {}, 4, {"A": 0.0, "B": 0.3}, index, min_match_ratio=0.1,
                         max_imbalance=4) == [["B"], ["A"]]  # ... before (possibly stale) KV usage


@pytest.mark.parametrize("path,body,key", [
    ("/v1/completions", {"prompt": "Hello there"}, "Hello there"),
    ("/v1/completions", {"prompt": ["first", "second"]}, "first"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, "1 2 3"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
     "system: Be brief.\nuser: Hi"),
    ("/v1/models", {}, None),
    ("/v1/completions", b"not json", None),
])
def test_routing_key(path, body, key):
    assert routing_key(path, body if isinstance(body, bytes) else json.dumps(body).encode()) == key


REFUSED_BODIES = [  # (path, body): each gets a 400 (or 413) from the replica
    ("/v1/completions", b"\xff\xfe not json"),
    ("/v1/completions", b"[1, 2]"),  # a list, not an object
    ("/v1/completions", b"[" * 100_000),  # nested past the JSON decoder's recursion guard
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}'),  # a lone surrogate: the key could not be hashed
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": [null, "x"]}'),
    ("/v1/completions", b'{"prompt": {"text": "x"}}'),
    ("/v1/completions", b'{"prompt": []}'),
    ("/v1/chat/completions", b'{"messages": "hello"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": ["user"], "content": [{"text": ["a"]}, "b", 3]}]}'),
    ("/v1/completions", b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}'),  # beyond the replica's body limit
]


def test_routing_key_never_raises_on_bodies_the_replica_refuses():
    """The ingress must not fail where the replica would answer 400: such a request routes by load
    (or on a harmless key), and every key can be hashed."""
    for path, body in REFUSED_BODIES:
        key = routing_key(path, body)
        assert key is None or (isinstance(key, str) and len(key.encode("utf-8")) <= 4 * MAX_KEY_CHARS), body[:80]


def test_routing_key_falls_back_to_load_routing_for_what_it_cannot_use():
    assert routing_key("/v1/completions", b"[" * 100_000) is None
    assert routing_key("/v1/completions", b'{"prompt": "a\\ud800b"}') is None
    assert routing_key("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"text": 5}]}]}') == "user: "
    long = "y" * (MAX_KEY_CHARS + 1000)
    assert routing_key("/v1/completions", json.dumps({"prompt": long}).encode()) == long[:MAX_KEY_CHARS]


def test_router_on_fake_replicas_sticks_prefixes_and_sheds_hot_replicas():
    long_a = "You are a careful assistant for the accounts team. " * 6
    long_b = "Summarise the following meeting notes in three bullet points. " * 6

    async def scenario():
        router = PrefixAffinityRouter(DeploymentID("PagedRuntimeServer", "app"), DeploymentHandleSource.UNKNOWN,
                                      use_replica_queue_len_cache=True)
        router.initialize_state(max_imbalance=4)
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])

        async def route(key: str | None) -> list[list[str]]:
            request = PendingRequest(args=[ForwardedRequest("POST", "/v1/completions", routing_key=key)], kwargs={},
                                     metadata=RequestMetadata(request_id="r", internal_request_id="r"))
            ranks = await router.choose_replicas([a, b], request)
            if key is not None:
                router.on_request_routed(request, ranks[0][0].replica_id, None)
            return [[r.replica_id.unique_id for r in rank] for rank in ranks]

        first = (await route(long_a + "question 1"))[0][0]
        other = "b" if first == "a" else "a"
        assert (await route(long_a + "question 2"))[0] == [first]  # same prefix, same replica
        assert (await route(long_b + "question 1"))[0] == [other]  # a fresh prefix goes to the emptier replica
        router.replica_queue_len_cache.update(ReplicaID(first, a.replica_id.deployment_id), 6)
        assert (await route(long_a + "question 3")) == [[other], [first]]  # the owner is hot: least loaded
        keyless = await route(None)
        assert len(keyless) == 1 and sorted(keyless[0]) == ["a", "b"]  # power of two choices
        router.update_replicas([a])  # b is gone: its prefixes with it
        assert router.index.num_chunks(b.replica_id) == 0

    asyncio.run(scenario())


# ---- the model replica, in-process ---------------------------------------------------------------------
def replica_args(model_dir, **overrides) -> dict:
    return {"model": str(model_dir), "served_model_name": "tiny", "dtype": "float32", "max_model_len": 512,
            "kv_cache_memory": 8 * 2**20, "max_num_seqs": 2, "debug_checks": True, **overrides}


@pytest.fixture(scope="module")
def replica(tiny_llama_dir):
    from rayserve_adapter.deployment import EngineReplica
    replica = EngineReplica(replica_args(tiny_llama_dir))
    yield replica
    replica.shutdown()


def forwarded(path: str, body: dict) -> ForwardedRequest:
    data = json.dumps(body).encode()
    return ForwardedRequest("POST", path, b"", JSON, data, routing_key(path, data))


async def wait_idle(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_unfinished_requests or engine.stats.kv_cache_usage or engine.stats.num_running:
        assert time.monotonic() < deadline, f"engine not idle: {engine.stats}"
        await asyncio.sleep(0.01)


def test_forward_runs_the_openai_app_and_a_closed_stream_aborts(replica):
    async def scenario():
        parts = [p async for p in replica.forward(forwarded("/v1/completions", {"prompt": "Hello", "max_tokens": 3,
                                                                                "ignore_eos": True}))]
        assert isinstance(parts[0], ResponseStart) and parts[0].status == 200
        body = json.loads(b"".join(parts[1:]))
        assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
        bad = [p async for p in replica.forward(forwarded("/v1/completions", {"prompt": "x", "max_tokens": 0}))]
        assert bad[0].status == 400 and json.loads(b"".join(bad[1:]))["error"]["param"] == "max_tokens"

        aborted_before = replica.record_routing_stats()["num_aborted_requests"]
        stream = replica.forward(forwarded("/v1/completions", {"prompt": "Hello", "max_tokens": 400,
                                                               "ignore_eos": True, "stream": True}))
        start = await stream.__anext__()
        assert start.status == 200 and start.header("content-type").startswith("text/event-stream")
        assert (await stream.__anext__()).startswith(b"data: ")
        assert replica.engine.num_unfinished_requests == 1
        await stream.aclose()  # what a cancelled handle call does to the generator
        await wait_idle(replica.engine)
        assert replica.record_routing_stats()["num_aborted_requests"] == aborted_before + 1

    asyncio.run(scenario())


def test_forward_keeps_the_http_edge_checks(replica):
    """What reaches a replica through the ingress meets the same 415 / 413 / 400 as a direct client."""
    async def status_and_error(request: ForwardedRequest) -> tuple[int, dict]:
        parts = [p async for p in replica.forward(request)]
        return parts[0].status, json.loads(b"".join(parts[1:]))["error"]

    async def scenario():
        body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
        plain = ForwardedRequest("POST", "/v1/completions", b"", ((b"content-type", b"text/plain"),), body)
        assert (await status_and_error(plain))[0] == 415
        huge = b'{"prompt": "' + b"x" * (16 * 2**20) + b'"}'
        assert (await status_and_error(ForwardedRequest("POST", "/v1/completions", b"", JSON, huge)))[0] == 413
        surrogate = ForwardedRequest("POST", "/v1/completions", b"", JSON, b'{"prompt": "\\ud800"}')
        status, error = await status_and_error(surrogate)
        assert (status, error["param"], error["code"]) == (400, "prompt", "invalid_unicode")
        deep = ForwardedRequest("POST", "/v1/chat/completions", b"", JSON, b"[" * 100_000)
        status, error = await status_and_error(deep)
        assert (status, error["code"]) == (400, "invalid_json")

    asyncio.run(scenario())


def test_stats_hooks_report_numbers(replica):
    autoscaling = replica.record_autoscaling_stats()
    assert set(autoscaling) == {"num_waiting", "kv_cache_usage", "num_running"}
    assert all(isinstance(v, (int, float)) for v in autoscaling.values())  # Serve drops non-numeric stats
    routing = replica.record_routing_stats()
    assert routing["healthy"] is True and routing["kv_cache_usage"] == 0.0
    assert routing["num_prefix_queries"] >= routing["num_prefix_hits"] >= 0
    replica.check_health()  # no raise


def test_a_draining_replica_is_not_ready(replica):
    replica.check_health()
    replica.drain.draining = True
    try:
        with pytest.raises(RuntimeError, match="draining"):
            replica.check_health()
    finally:
        replica.drain.draining = False


def test_reconfigure_lowers_max_num_seqs_live_without_preempting(replica):
    """Two requests run at max_num_seqs 2; lowered to 1, a third is admitted only once both have finished."""
    engine = replica.engine
    from paged_runtime import SamplingParams

    async def scenario():
        finished_order = []

        async def run(name: str, max_tokens: int) -> None:
            async for out in engine.generate("Hello there", SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                if out.finished:
                    finished_order.append(name)

        first = [asyncio.create_task(run(name, 30)) for name in ("a", "b")]
        deadline = time.monotonic() + 30
        while engine.stats.num_running < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        replica.reconfigure({"max_num_seqs": 1})
        third = asyncio.create_task(run("c", 1))
        await asyncio.gather(*first, third)
        assert finished_order[-1] == "c" and sorted(finished_order[:2]) == ["a", "b"]
        # The declared limit, and the scheduler's own once a and b left (it never went below the running ones).
        assert engine.max_num_seqs == 1 and engine.engine.core.scheduler.max_num_seqs == 1

        replica.reconfigure({"max_num_seqs": 3})  # above the built-in 2: three run together at once
        wider = [asyncio.create_task(run(name, 40)) for name in ("d", "e", "f")]
        deadline = time.monotonic() + 30
        while engine.stats.num_running < 3:
            assert time.monotonic() < deadline, engine.stats
            await asyncio.sleep(0.002)
        await asyncio.gather(*wider)
        replica.reconfigure({"max_num_seqs": 2})
        await wait_idle(engine)

    asyncio.run(scenario())
    assert engine.is_healthy  # the scheduler's invariants (checked every step) held throughout
    with pytest.raises(ValueError, match="cannot be changed live"):
        replica.reconfigure({"block_size": 32})
    replica.reconfigure({"max_waiting_requests": 3})
    assert engine.max_waiting_requests == 3
    replica.reconfigure({"max_waiting_requests": None})


def test_check_health_fails_once_the_step_loop_died(tiny_llama_dir):
    from paged_runtime.engine.async_engine import EngineDeadError
    from paged_runtime import SamplingParams
    from rayserve_adapter.deployment import EngineReplica
    doomed = EngineReplica(replica_args(tiny_llama_dir, served_model_name="doomed"))
    try:
        doomed.check_health()
        stepped = threading.Event()

        def failing_step():
            stepped.set()
            raise RuntimeError("simulated device failure")

        doomed.engine.engine.step = failing_step

        async def submit():
            with pytest.raises(EngineDeadError, match="simulated device failure"):
                async for _ in doomed.engine.generate("Hello", SamplingParams(max_tokens=4)):
                    pass

        asyncio.run(submit())
        assert stepped.is_set()
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            doomed.check_health()
        assert doomed.record_routing_stats()["healthy"] is False
    finally:
        doomed.shutdown()
