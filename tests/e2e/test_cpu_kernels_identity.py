"""The compiled CPU kernels give the same greedy tokens as the plain PyTorch path (float32, also over a bfloat16
KV cache), with every engine feature on: chunked prefill mixed with decodes, prefix-cache hits, preemption,
n-gram speculation, decode batches both within the fused kernel's row limit and beyond it."""
from __future__ import annotations

import os
import random
import statistics

import pytest
import torch

from tests.conftest import assert_idle, count_decode_steps, make_llm, save_tiny_llama
from tests.helpers.near_ties import first_difference, logprob_differences, parting_problems
from paged_runtime import SamplingParams
from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.worker.cpu_decode_plan import CpuDecodePlan

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")]

TINY_BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads, head dim 16, fp32, 16 tokens


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    system = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (1, 9, 30, 77, 150, 3)]
    prompts += [[rng.randrange(3, 49152) for _ in range(n)] for n in (2, 64, 200, 17, 120, 33, 5, 260)]
    prompts += [[11, 12, 13, 14] * 10]  # repetitive: n-gram drafts
    prompts += [[rng.randrange(3, 49152) for _ in range(n)] for n in (4, 8, 2, 6, 9, 3, 5, 7) * 5]  # > 32 at once
    params = [SamplingParams(max_tokens=12 + 5 * (i % 6), temperature=0, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def completions(llm, prompts, params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def generate(llm, prompts, params) -> list[list[int]]:
    return [c.token_ids for c in completions(llm, prompts, params)]


@pytest.mark.parametrize("max_num_seqs, num_blocks", [(4, 24), (48, 128)], ids=["fused-layer", "per-op"])
@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram"])
def test_kernels_match_the_pytorch_path(tiny_llama_dir, monkeypatch, max_num_seqs, num_blocks, speculative_config):
    fused_calls, row_steps = count_decode_steps(monkeypatch), []
    decoder = CpuDecodePlan.decoder
    monkeypatch.setattr(CpuDecodePlan, "decoder",
                        lambda self, meta: (meta.rows_only and row_steps.append(meta.num_tokens)) or decoder(self, meta))
    prompts, params = workload()
    # 24 blocks of 16 tokens: too few for every request at once (preemption); 128 let more than
    # MAX_ROWS decode at once (the per-operation path); a 64-token step budget (chunked prefill beside decodes).
    common = dict(max_model_len=384, max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                  kv_cache_memory=num_blocks * TINY_BYTES_PER_BLOCK, speculative_config=speculative_config)
    eager = make_llm(tiny_llama_dir, enforce_eager=True, **common)
    kernels = make_llm(tiny_llama_dir, cpu_kernels=True, **common)  # on every CPU, AVX-512 or not
    assert kernels.engine.core.ops.name == "cpu-kernels" and eager.engine.core.ops.name == "torch"
    expected = generate(eager, prompts, params)
    eager_fused_calls = len(fused_calls)
    assert generate(kernels, prompts, params) == expected
    assert eager_fused_calls == 0 and len(fused_calls) > 0  # the compiled decode step ran, only with the kernels
    if max_num_seqs > cpu.max_rows():
        assert max(row_steps) > cpu.max_rows()  # decodes too many for the compiled step ran op by op
    else:
        assert kernels.engine.core.scheduler.num_preemptions > 0
    assert kernels.engine.core.kv_cache.num_hit_tokens > 0
    assert_idle(kernels)


# float32 activations over a bfloat16 cache: both paths store each K/V element rounded to bfloat16, but their
# float32 sums differ in order, and where one lands the element's value on the other side of a rounding midpoint
# the two caches hold it one bfloat16 step apart (2^-8 relative). That moves a logprob by up to ~5e-3 nats here
# (measured on a Xeon with AMX, whose PyTorch sums in AVX-512 order: a Zen 3's happened to give the same tokens),
# and flips a greedy token where the top two are closer than that. Almost every logprob agrees to float32's noise.
# Rounding by truncation instead (into K only) moved them by up to 0.12 nats, the median by 6e-3 (measured).
BFLOAT16_STEP_NATS = 0.02  # the most any logprob, or a parting's gap, may move
FLOAT32_NOISE_NATS = 1e-4  # the most the median logprob may move


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram"])
def test_a_bfloat16_cache_under_float32_gives_the_pytorch_paths_tokens(tiny_llama_dir, monkeypatch,
                                                                       speculative_config):
    """float32 activations over a bfloat16 KV cache (a GGUF's default on the CPU): the compiled decode step and
    the C attention, which round K/V into the cache and widen them back themselves, give the plain PyTorch path's
    tokens until a near-tie, and its logprobs within a bfloat16 step, with chunked prefill, prefix-cache hits and
    preemption (24 blocks, half float32's bytes each)."""
    fused_calls = count_decode_steps(monkeypatch)
    prompts, params = workload()
    for p in params:
        p.logprobs = 3
    common = dict(kv_cache_dtype="bfloat16", max_model_len=384, max_num_batched_tokens=64, max_num_seqs=4,
                  kv_cache_memory=24 * TINY_BYTES_PER_BLOCK // 2, speculative_config=speculative_config)
    eager = make_llm(tiny_llama_dir, enforce_eager=True, **common)
    kernels = make_llm(tiny_llama_dir, cpu_kernels=True, **common)
    for llm in (eager, kernels):
        core = llm.engine.core
        assert (core.dtype, core.num_blocks) == (torch.float32, 24)
        assert core.executor.worker.model.layers[0].self_attn.attn.kv_cache.dtype == torch.bfloat16
    assert kernels.engine.core.ops.name == "cpu-kernels" and eager.engine.core.ops.name == "torch"
    expected = completions(eager, prompts, params)
    assert not fused_calls
    got = completions(kernels, prompts, params)
    assert fused_calls
    assert not parting_problems(expected, got, BFLOAT16_STEP_NATS)
    diffs = logprob_differences(expected, got)
    assert max(diffs) <= BFLOAT16_STEP_NATS and statistics.median(diffs) <= FLOAT32_NOISE_NATS
    assert sum(first_difference(e, g) is None for e, g in zip(expected, got)) >= len(prompts) - 2
    assert kernels.engine.core.scheduler.num_preemptions > 0
    assert kernels.engine.core.kv_cache.num_hit_tokens > 0
    assert_idle(kernels)


@pytest.fixture(scope="module")
def three_kv_heads_dir(tmp_path_factory, smollm2_dir):
    """A 2-layer Llama whose attention has 3 KV heads of 64 dims (SmolLM2's count and size), tied embeddings, and
    the tiny Llama's large weights (clear greedy margins)."""
    return save_tiny_llama(tmp_path_factory.mktemp("three-kv-heads"), smollm2_dir, hidden_size=192,
                           intermediate_size=256, num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=True)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no team to share a row")
def test_a_long_row_alone_shared_by_the_threads_gives_the_pytorch_paths_tokens(three_kv_heads_dir, monkeypatch):
    """One request decoding alone past 256 tokens of context, its 3 KV heads not a multiple of the threads: the
    compiled decode step's attention shares the row's keys, heads and value dims between the threads (each
    thread's scratch and the shared scores inside the step's buffer). Same greedy tokens as the PyTorch path."""
    fused_calls = count_decode_steps(monkeypatch)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(300)]]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    eager = make_llm(three_kv_heads_dir, enforce_eager=True, max_model_len=512)
    kernels = make_llm(three_kv_heads_dir, cpu_kernels=True, max_model_len=512)
    expected = generate(eager, prompts, params)
    assert generate(kernels, prompts, params) == expected
    assert len(fused_calls) >= 23 and {rows for _, rows in fused_calls} == {1}  # each decode step, 300-323 tokens
    assert_idle(kernels)
