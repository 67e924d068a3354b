"""Asynchronous scheduling (step N + 1 scheduled and launched before step N's output is in) changes no output.

The engine runs with a small token budget (chunked prefill), a KV cache too small for every request at once
(preemption), shared prompt prefixes (prefix-cache hits), parallel sampling, seeded sampling with filters,
penalties, logprobs, min_tokens and stop strings; every output must equal the synchronous
engine's, token for token and logprob for logprob, and greedy ones transformers'. Each test also checks
that requests really were scheduled ahead with a placeholder token, so the path under test ran.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams, StructuredOutputsParams
from paged_runtime.config import EngineConfig

TINY_BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads, head dim 16, fp32, 16 tokens


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()


def count_scheduled_ahead(llm) -> list[int]:
    """Wraps the runner: counts step items whose last token was still being sampled when they were scheduled."""
    runner, counter = llm.engine.core.runner, [0]
    execute = runner.execute

    def counting(out):
        counter[0] += sum(len(s.token_ids) < s.num_new_tokens for s in out.scheduled)
        return execute(out)

    runner.execute = counting
    return counter


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(40)]  # a common prefix: prefix-cache hits
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 33, 130, 260, 17, 64, 300)]
    prompts += [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 9, 21)]
    params = [SamplingParams(max_tokens=8 + (i * 7) % 30, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.9, seed=3, ignore_eos=True)
    params[2] = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                               logprobs=2, ignore_eos=True)
    params[5] = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    params[6] = SamplingParams(max_tokens=1, temperature=0)  # finished by its first token
    params[8] = SamplingParams(max_tokens=30, temperature=0, min_tokens=5, ignore_eos=True)
    params[9] = SamplingParams(max_tokens=20, temperature=0,  # the grammar follows the runner's history
                               structured_outputs=StructuredOutputsParams(regex="[a-z]+( [a-z]+){2}"))
    return prompts, params


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


def small_engine(model_dir, async_scheduling: bool, **kwargs):
    return make_llm(model_dir, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=6,
                    kv_cache_memory=40 * TINY_BYTES_PER_BLOCK, async_scheduling=async_scheduling, **kwargs)


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_async_scheduling_changes_no_output(tiny_llama_dir, tiny_hf):
    prompts, params = workload(seed=5)
    expected = generate(small_engine(tiny_llama_dir, False), prompts, params)
    llm = small_engine(tiny_llama_dir, True)
    core = llm.engine.core
    assert core.async_scheduling
    ahead = count_scheduled_ahead(llm)
    assert generate(llm, prompts, params) == expected
    assert ahead[0] > 50, "decodes were meant to be scheduled while their step ran"
    assert core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert core.kv_cache.num_hit_tokens > 0, "the shared prefix was meant to hit the prefix cache"
    for prompt, p, outs in zip(prompts, params, expected):
        if p.temperature == 0 and p.repetition_penalty == 1 and p.min_tokens == 0 and not p.structured_outputs:
            assert outs[0][0] == hf_greedy(tiny_hf, prompt, p.max_tokens)
    assert_idle(llm)


def test_async_scheduling_refuses_speculative_decoding(tiny_llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="async_scheduling does not combine with speculative decoding"):
        small_engine(tiny_llama_dir, True, speculative_config=spec)
    assert not small_engine(tiny_llama_dir, None, speculative_config=spec).engine.core.async_scheduling


def schedules_holding(llm) -> list[set[str]]:
    """Wraps the scheduler: the (internal) ids of the requests in each step it schedules."""
    scheduler, steps = llm.engine.core.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        steps.append({s.request_id for s in out.scheduled})
        return out

    scheduler.schedule = recording
    return steps


def test_stop_strings_and_aborts_take_effect_within_one_step(tiny_llama_dir):
    """A request that stops (stop string) or is aborted between steps is in no step scheduled after that:
    only in the one already in flight."""
    llm = small_engine(tiny_llama_dir, True)
    engine = llm.engine
    probe = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=12, temperature=0),
                         use_tqdm=False)[0].outputs[0]
    stop = probe.text[len(probe.text) // 2:][:3]  # a stop string partway through the output
    steps = schedules_holding(llm)
    engine.add_request("stopped", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    engine.add_request("aborted", [9, 10, 11], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request("other", [20, 21], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    internal = {rid: engine._group_ids[rid] for rid in ("stopped", "aborted")}
    finished, num_steps_at, outputs_after_abort = {}, {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "aborted" and "aborted" in num_steps_at:
                outputs_after_abort.append(out)
            if out.finished:
                finished[out.request_id] = out
                num_steps_at[out.request_id] = len(steps)
        if len(steps) == 4:
            engine.abort_request(["aborted"])
            num_steps_at["aborted"] = len(steps)
    assert finished["stopped"].outputs[0].finish_reason == "stop"
    assert stop not in finished["stopped"].outputs[0].text
    for request_id, at in num_steps_at.items():
        if request_id in internal:
            assert internal[request_id] in steps[at - 1], f"{request_id} was meant to be in the step in flight"
            assert not [s for s in steps[at:] if internal[request_id] in s], f"{request_id} was scheduled again"
    assert not outputs_after_abort
    assert finished["other"].outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_beam_search_runs_its_steps_synchronously(tiny_llama_dir):
    from paged_runtime import BeamSearchParams
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(30, 50))}]
    beam = BeamSearchParams(beam_width=3, max_tokens=8)
    results = [make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=4 * 2**20, async_scheduling=mode)
               .beam_search(prompts, beam) for mode in (False, True)]
    assert [[s.tokens for s in r.sequences] for r in results[0]] == [[s.tokens for s in r.sequences] for r in results[1]]


def test_asynchronous_scheduling_is_off_by_default_on_the_cpu(tiny_llama_dir):
    assert EngineConfig().async_scheduling is None
    assert not make_llm(tiny_llama_dir, max_model_len=64, kv_cache_memory=2**20).engine.core.async_scheduling
