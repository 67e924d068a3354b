"""Tensor parallelism over Ray actors (``distributed_executor_backend="ray"``) on a local Ray cluster, CPU,
gloo: the same greedy tokens as one device; a worker's error comes back as its own; a dead actor stops the
executor; shutdown leaves no actor and no placement group behind; a Ray Serve replica with two ranks
(``rayserve_adapter``) places them in its own placement group and answers as one device does.

One module-scoped Ray cluster and one TP=2 engine (the failure test kills one of its ranks: it runs after
the others that use it).
"""
from __future__ import annotations

import os
import socket
import time

import httpx

import pytest

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.parallel]

ray = pytest.importorskip("ray")

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
ENGINE = dict(max_model_len=256, max_num_batched_tokens=24, max_num_seqs=4, block_size=16,
              kv_cache_memory=2**20)  # per rank
PROMPTS = [[1, 17, 300, 42, 9, 5000, 77, 12] * 4 + [100 + i] * (3 + 9 * i) for i in range(3)]  # chunked by 24
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PAIR = SamplingParams(n=2, max_tokens=8, temperature=0, ignore_eos=True)


def run(llm) -> list:
    params = [GREEDY] * len(PROMPTS) + [PAIR]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [PROMPTS[0][:10]]], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def cluster():
    saved = {key: os.environ.get(key) for key in RAY_ENV}
    os.environ.update(RAY_ENV)
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def one_device(tiny_llama_dir):
    return make_llm(tiny_llama_dir, **ENGINE)


@pytest.fixture(scope="module")
def reference(one_device):
    return run(one_device)


@pytest.fixture(scope="module")
def llm(cluster, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    yield llm
    llm.engine.core.shutdown()


def test_ray_ranks_generate_the_tokens_of_one_device(llm, reference):
    from paged_runtime.executor.ray_executor import RayExecutor
    assert isinstance(llm.engine.core.executor, RayExecutor)
    assert run(llm) == reference
    assert_idle(llm)


def test_a_workers_error_comes_back_as_its_own_and_the_executor_goes_on(llm, reference):
    executor = llm.engine.core.executor
    with pytest.raises(AttributeError, match="no_such_method"):
        executor.call("no_such_method")
    executor.check_health()
    assert executor.alive()
    assert run(llm) == reference


def test_a_dead_rank_stops_the_executor_and_nothing_is_left_behind(llm):
    from paged_runtime.executor import ExecutorDead
    executor = llm.engine.core.executor
    group = executor.group
    ray.kill(executor.actors[1], no_restart=True)  # asynchronous: the kill lands a moment later
    eventually(lambda: not executor.alive(), "the killed actor still answers")
    # alive() only looks: the other rank runs until check_health gives up on the executor
    assert ray.get(executor.actors[0].ping.remote(), timeout=30)
    with pytest.raises(ExecutorDead):
        executor.check_health()
    with pytest.raises(ExecutorDead):  # and every call after it
        executor.call("retain", set())
    for actor in executor.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
    eventually(lambda: ray.util.placement_group_table(group)["state"] == "REMOVED", "the group is removed")
    executor.shutdown()  # idempotent


def test_a_rank_that_fails_to_build_raises_its_own_error_and_leaves_nothing(cluster, tiny_llama_dir, tmp_path):
    import shutil

    import torch

    from paged_runtime.config import EngineConfig
    from paged_runtime.executor.ray_executor import RayExecutor
    from paged_runtime.worker.worker import WorkerSpec
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")  # no weights
    before, groups_before = rank_actors_alive(), created_groups()
    config = EngineConfig(device="cpu", tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="no \\*.safetensors weights") as failure:
        RayExecutor(WorkerSpec(config, tmp_path, torch.float32, 64))
    assert type(failure.value) is ValueError  # the worker's own, not Ray's wrapper
    eventually(lambda: rank_actors_alive() == before, "the ranks of a failed start are killed")
    eventually(lambda: created_groups() == groups_before, "the failed start's placement group is removed")


def eventually(predicate, what: str) -> None:
    """Ray kills actors and removes groups asynchronously: wait (30 s at most) for the state to show it."""
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what


def rank_actors_alive() -> int:
    from ray._private.state import actors  # the state API proper needs the dashboard, off here
    return sum(a["ActorClassName"] == "RankActor" and a["State"] == "ALIVE" for a in actors().values())


def created_groups() -> dict:
    return {key: g for key, g in ray.util.placement_group_table().items() if g["state"] == "CREATED"}


def test_a_serve_replica_runs_its_ranks_in_its_own_placement_group(cluster, one_device, tiny_llama_dir):
    from ray import serve

    from rayserve_adapter import app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": str(tiny_llama_dir), "served_model_name": "tiny", "dtype": "float32", "device": "cpu",
            "num_cpus": 0, "tensor_parallel_size": 2, "debug_checks": True, "shutdown_timeout": 1,
            **{k: v for k, v in ENGINE.items() if k != "max_num_batched_tokens"}}
    ranks_before, groups_before = rank_actors_alive(), created_groups()
    try:
        serve.run(app(args), name="tp", route_prefix="/")
        groups = [g for key, g in created_groups().items() if key not in groups_before]
        # Serve's group for the replica, one CPU bundle per rank; the executor made none of its own.
        assert [(list(g["bundles"].values()), g["strategy"]) for g in groups] == [
            ([{"CPU": 1.0}, {"CPU": 1.0}], "STRICT_PACK")]
        assert rank_actors_alive() == ranks_before + 2
        prompt = PROMPTS[1]
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200
        want = one_device.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].text
        assert response.json()["choices"][0]["text"] == want
        serve.delete("tp")
        eventually(lambda: rank_actors_alive() == ranks_before, "rank actors outlived their replica (their owner)")
    finally:
        serve.shutdown()
