"""Tensor and pipeline parallelism on the CPU (gloo, one worker process per rank): the same outputs as one
device, with every engine feature on.

One module-scoped engine per layout (TP=2, PP=2, TP=2 x PP=2), against one single-device engine with the same
settings. Each rank's cache holds exactly ``NUM_BLOCKS`` blocks in every layout (``kv_cache_memory`` is per
rank, and a rank holds 1/tp of the KV heads of 1/pp of the layers), so the workload preempts alike.
"""
from __future__ import annotations

import multiprocessing

import pytest

from paged_runtime import SamplingParams
from paged_runtime.sampling_params import StructuredOutputsParams

from tests.conftest import assert_idle, make_llm, process_alive

pytestmark = [pytest.mark.parallel]

NUM_BLOCKS = 24
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K and V x 2 layers x 2 KV heads x head dim 16 x fp32 x 16 tokens
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2-pp2": (2, 2)}
SHARED = [1, 17, 300, 42, 9, 5000, 77, 12, 18, 600, 33, 4, 21, 9000, 8, 15, 44, 3] * 2  # a cached prefix


def engine_kwargs(tp: int, pp: int) -> dict:
    return dict(max_model_len=256, max_num_batched_tokens=40, max_num_seqs=8, block_size=16,
                kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES // (tp * pp), tensor_parallel_size=tp,
                pipeline_parallel_size=pp)


def workload() -> list[tuple[list[int], SamplingParams]]:
    """Long prompts (chunked by the 40-token budget), a shared prefix (prefix hits), more KV than the cache
    holds at once (preemption), n > 1 (copy-on-write forks), seeded sampling, logprobs and prompt logprobs
    (extra rows in the LM-head product) and a grammar (on the sampling rank only)."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    jobs = [(SHARED + [100 + i] * (5 + 7 * i), greedy) for i in range(6)]
    jobs.append((SHARED + [7, 8, 9], SamplingParams(n=2, max_tokens=20, temperature=0, ignore_eos=True)))
    jobs.append(([5, 6, 7, 8] * 9, SamplingParams(n=3, max_tokens=16, temperature=1.0, top_k=50, seed=11,
                                                  ignore_eos=True)))
    jobs.append(([3, 1, 4, 1, 5, 9, 2, 6] * 4, SamplingParams(max_tokens=10, temperature=0, logprobs=3,
                                                                prompt_logprobs=2, ignore_eos=True)))
    jobs.append(([11, 12, 13] * 5, SamplingParams(max_tokens=12, temperature=0,
                                                  structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]+"))))
    return jobs


def run(llm) -> list:
    prompts = [{"prompt_token_ids": ids} for ids, _ in workload()]
    return llm.generate(prompts, [params for _, params in workload()], use_tqdm=False)


def summary(outputs) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, **engine_kwargs(1, 1))
    return run(llm), llm.engine.stats().num_preemptions, llm.engine.cpu_kernels


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel_llm(request, tiny_llama_dir):
    tp, pp = LAYOUTS[request.param]
    llm = make_llm(tiny_llama_dir, **engine_kwargs(tp, pp))
    yield llm
    llm.engine.shutdown()


def test_parallel_outputs_equal_one_device(parallel_llm, reference):
    want, want_preemptions, want_kernels = reference
    assert parallel_llm.engine.core.num_blocks == NUM_BLOCKS
    # each rank's process loads the kernels itself; the engine shows the driver's, carried in its WorkerInfo
    assert parallel_llm.engine.cpu_kernels == want_kernels
    got = run(parallel_llm)
    assert summary(got) == summary(want)
    assert want_preemptions > 0 and parallel_llm.engine.stats().num_preemptions == want_preemptions
    assert parallel_llm.engine.stats().num_prefix_hits > 0
    # Partial products are summed in another order across ranks: logprobs agree to rounding.
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            if wc.logprobs:
                assert [e[t].logprob for e, t in zip(gc.logprobs, gc.token_ids)] == pytest.approx(
                    [e[t].logprob for e, t in zip(wc.logprobs, wc.token_ids)], abs=1e-4)
        if w.prompt_logprobs:
            assert [sorted(e) if e else e for e in g.prompt_logprobs] == [sorted(e) if e else e
                                                                         for e in w.prompt_logprobs]
    assert_idle(parallel_llm)


def test_shutdown_leaves_no_worker_process(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, **engine_kwargs(2, 1))
    pids = llm.engine.core.executor.worker_pids
    assert len(pids) == 2 and all(process_alive(pid) for pid in pids)
    llm.engine.shutdown()
    llm.engine.shutdown()  # idempotent
    assert not any(process_alive(pid) for pid in pids)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), "sizes that work: 1, 2, 4"),
    (dict(pipeline_parallel_size=3), "use at most 2"),
    (dict(tensor_parallel_size=2, async_scheduling=True), "async_scheduling needs one device"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="slurm"),
     "distributed_executor_backend must be one of mp, ray; got .slurm."),
])
def test_sizes_the_model_cannot_take_are_refused_before_any_worker_starts(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama_dir, **kwargs)


def test_ngram_speculation_with_tensor_parallelism_keeps_the_greedy_tokens(tiny_llama_dir):
    prompts = [{"prompt_token_ids": [1, 5, 9, 100 + i, 7, 3] * (i + 3)} for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = make_llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, speculative_config=spec)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert summary(got) == summary(want)
        assert llm.engine.stats().spec.num_drafts > 0  # verification steps ran on both ranks
    finally:
        llm.engine.shutdown()


def test_a_worker_that_cannot_start_fails_the_engine_and_stops_the_others(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_llama_dir.iterdir():
        (broken / f.name).symlink_to(f)
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = set(multiprocessing.active_children())  # other tests' engines may still be up
    with pytest.raises(ValueError, match="corrupt safetensors file"):  # the worker's own error, as it raised it
        make_llm(broken, tensor_parallel_size=2)
    assert not [p for p in set(multiprocessing.active_children()) - before
                if p.name.startswith("paged-runtime-worker")]
