"""Tensor parallelism over Ray actors (``distributed_executor_backend="ray"``) on a local Ray cluster, CPU,
gloo: the same greedy tokens as one device; a worker's error comes back as its own; a dead actor stops the
executor; shutdown leaves no actor and no placement group behind.

One module-scoped Ray cluster and one TP=2 engine (the failure test runs last: it kills a rank).
"""
from __future__ import annotations

import os
import time

import pytest

from conftest import assert_idle, make_llm
from paged_runtime import SamplingParams

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
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
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
def reference(tiny_llama_dir):
    return run(make_llm(tiny_llama_dir, **ENGINE))


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
    deadline = time.monotonic() + 30
    while executor.alive():
        assert time.monotonic() < deadline, "the killed actor still answers"
    # alive() only looks: the other rank runs until check_health gives up on the executor
    assert ray.get(executor.actors[0].ping.remote(), timeout=30)
    with pytest.raises(ExecutorDead):
        executor.check_health()
    with pytest.raises(ExecutorDead):  # and every call after it
        executor.call("retain", set())
    for actor in executor.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    executor.shutdown()  # idempotent
