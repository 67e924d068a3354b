"""The full sampler end to end: logprobs against transformers, n / best_of, seeds, min_tokens."""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256, max_num_seqs=64, max_num_batched_tokens=128,
                    kv_cache_memory=8 * 2**20)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    # The dequantized weights transformers loads too (quantization="none").
    return make_llm(smollm2_dir, quantization="none", max_model_len=256, max_num_seqs=64, kv_cache_memory=96 * 2**20)


def hf_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def test_logprobs_and_prompt_logprobs_equal_transformers(tiny, tiny_llama_dir):
    prompt = list(range(1000, 1040))
    [out] = tiny.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=3), use_tqdm=False)
    completion = out.outputs[0]
    reference = hf_logprobs(tiny_llama_dir, prompt + completion.token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the top token
        top = row.topk(5)
        assert list(entry)[:1] == [token] and set(entry) == set(top.indices.tolist())
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[token_id].logprob - value) < 1e-4
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                              zip(completion.token_ids, completion.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[position], reference[position - 1]
        token = prompt[position]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert len(entry) in (3, 4)
    assert_idle(tiny)


def test_prompt_logprobs_survive_chunking_and_preemption(tiny_llama_dir):
    prompt = list(range(2000, 2100))
    small = make_llm(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=32,
                     kv_cache_memory=16 * 16 * (2 * 2 * 2 * 16 * 4))
    params = SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=0)
    outs = small.generate([{"prompt_token_ids": prompt}] * 3, params, use_tqdm=False)
    reference = hf_logprobs(tiny_llama_dir, prompt)
    assert small.engine.core.scheduler.num_preemptions > 0
    for out in outs:
        assert len(out.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            value = out.prompt_logprobs[position][prompt[position]].logprob
            assert abs(value - reference[position - 1, prompt[position]].item()) < 1e-4
    assert_idle(small)


def test_n_returns_n_distinct_seeded_completions(tiny):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=11)
    [out] = tiny.generate(["a story about"], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    [again] = tiny.generate(["a story about"], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_idle(tiny)


def test_best_of_returns_the_n_most_likely(tiny):
    params = SamplingParams(n=2, best_of=5, max_tokens=8, temperature=1.0, seed=3)
    [best] = tiny.generate(["once"], params, use_tqdm=False)
    everything = SamplingParams(n=5, max_tokens=8, temperature=1.0, seed=3, logprobs=0)
    [pool] = tiny.generate(["once"], everything, use_tqdm=False)
    ranked = sorted(pool.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]


def test_parallel_sampling_prefills_the_prompt_once(tiny):
    prompt = list(range(3000, 3040))
    core = tiny.engine.core
    computed = []
    original = core.runner.execute
    core.runner.execute = lambda out: computed.append(out.num_batched_tokens) or original(out)
    try:
        tiny.generate([{"prompt_token_ids": prompt}], SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=0),
                      use_tqdm=False)
    finally:
        core.runner.execute = original
    # 39 prompt tokens once, then the last prompt token per sequence, then 2 decode steps of 4.
    assert computed == [39, 4, 4, 4]


@pytest.mark.slow
def test_seeded_request_ignores_63_neighbours_and_order(tiny, smol):
    for llm in (tiny, smol):
        seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=2024)
        [alone] = llm.generate(["The weather today is"], seeded, use_tqdm=False)
        rng = random.Random(0)
        others = [(f"neighbour {i}", SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.random(),
                                                   seed=rng.choice([None, i]), top_k=rng.choice([0, 5])))
                  for i in range(63)]
        batch = others[:20] + [("The weather today is", seeded)] + others[20:]
        rng.shuffle(batch)
        outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
        position = [i for i, (_, sp) in enumerate(batch) if sp is seeded][0]
        assert outs[position].outputs[0].token_ids == alone.outputs[0].token_ids
        assert_idle(llm)


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_llama_dir):
    params = SamplingParams(max_tokens=10, temperature=1.0)
    runs = [make_llm(tiny_llama_dir, max_model_len=128, kv_cache_memory=2**20, seed=5)
            .generate(["hello"] * 3, params, use_tqdm=False) for _ in range(2)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


@pytest.mark.slow
def test_min_tokens_matches_transformers(smol, smollm2_dir):
    from transformers import AutoModelForCausalLM
    messages = [{"role": "user", "content": "Say hi."}]
    [free] = smol.chat(messages, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
    natural = len(free.outputs[0].token_ids)
    assert free.outputs[0].finish_reason == "stop"
    [forced] = smol.chat(messages, SamplingParams(max_tokens=64, temperature=0, min_tokens=natural + 4),
                         use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([forced.prompt_token_ids])
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64,
                           min_new_tokens=natural + 4, do_sample=False, top_k=None, top_p=None,
                           temperature=None)[0, prompt.shape[1]:].tolist()
    assert forced.outputs[0].token_ids == expected
    assert len(forced.outputs[0].token_ids) >= natural + 4


def test_stop_string_across_a_token_boundary(smol):
    prompt = "The capital of France is"
    [free] = smol.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    tokenizer = smol.get_tokenizer()
    ids = free.outputs[0].token_ids
    pieces = [tokenizer.decode(ids[:i]) for i in range(1, len(ids) + 1)]
    # A stop string made of the last character of token 1 and the first of token 2.
    boundary = len(pieces[0])
    stop = free.outputs[0].text[boundary - 1:boundary + 1]
    [stopped] = smol.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[stop]), use_tqdm=False)
    assert stopped.outputs[0].text == free.outputs[0].text[:free.outputs[0].text.index(stop)]
    assert stopped.outputs[0].stop_reason == stop and len(stopped.outputs[0].token_ids) == 2
