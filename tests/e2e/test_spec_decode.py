"""Speculative decoding end to end: greedy outputs identical with and without it, sampled
outputs distributed as the target's, seeds batch-invariant, no block leaked."""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, make_llm
from tests.helpers.ngram import oracle_ngram
from paged_runtime import SamplingParams
from paged_runtime.spec_decode.truncated_draft import write_truncated_draft

TINY_BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 KV heads, head dim 16, fp32, 16 tokens


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny target's first layer: same vocabulary, correlated but different guesses."""
    return write_truncated_draft(tiny_llama_dir, tmp_path_factory.mktemp("tiny-draft"), 1)


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 40, 130, 17, 260, 64, 3, 90)]
    prompts += [[11, 12, 13, 14] * 12, [7, 8] * 40 + [9], list(range(300, 340)) * 3]  # repetitive: n-gram hits
    params = [SamplingParams(max_tokens=20 + 7 * (i % 5), temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=40, temperature=0, logprobs=3)  # speculates, with logprobs
    params[3] = SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3)  # decodes without speculation
    params[9] = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[8])  # a stop inside accepted drafts
    return prompts, params


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    prompts, params = workload(0)
    return run(make_llm(tiny_llama_dir, max_model_len=512, kv_cache_memory=8 * 2**20), prompts, params)


@pytest.mark.parametrize("spec, blocks_per_target_block", [
    ({"method": "ngram", "num_speculative_tokens": 3, "oracle": True}, 1),
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3}, 1),
    ({"method": "draft_model", "model": "SELF", "num_speculative_tokens": 4}, 2),  # draft == target: all accepted
    ({"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 2}, 1.5),
], ids=["ngram-oracle-k3", "ngram-k5", "draft-self-k4", "draft-1layer-k2"])
def test_greedy_is_identical_with_chunking_and_preemption(tiny_llama_dir, tiny_draft_dir, reference, spec,
                                                          blocks_per_target_block, monkeypatch):
    spec = dict(spec)
    if spec.pop("oracle", False):
        from paged_runtime.spec_decode.ngram import NgramProposer
        prompts, _ = workload(0)
        monkeypatch.setattr(NgramProposer, "propose",
                            oracle_ngram([p + r.token_ids for p, r in zip(prompts, reference)]))
    if spec.get("model") in ("SELF", "DRAFT"):
        spec["model"] = str(tiny_llama_dir if spec["model"] == "SELF" else tiny_draft_dir)
    # 40 blocks of 16 tokens for ~1,300 tokens of prompts and ~330 of outputs: preemption is certain.
    budget = int(40 * TINY_BYTES_PER_BLOCK * blocks_per_target_block)
    llm = make_llm(tiny_llama_dir, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=6,
                   kv_cache_memory=budget, speculative_config=spec)
    assert llm.engine.core.num_blocks == 40
    prompts, params = workload(0)
    outs = run(llm, prompts, params)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    stats = core.spec_stats
    if spec.get("model") == str(tiny_llama_dir):
        assert 0 < stats.num_accepted_tokens == stats.num_draft_tokens  # fp32: the same model agrees with itself
    elif spec["num_speculative_tokens"] != 5:  # k5 is the real n-gram proposer: the random model gives it no hits
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref.token_ids, f"request {i} diverged"
        assert out.finish_reason == ref.finish_reason
    for entry, ref_entry in zip(outs[1].logprobs, reference[1].logprobs):
        assert entry.keys() == ref_entry.keys()
        for token in entry:
            assert abs(entry[token].logprob - ref_entry[token].logprob) < 1e-4
            assert entry[token].rank == ref_entry[token].rank
    assert_idle(llm)


def test_unverified_tokens_never_enter_the_prefix_cache(tiny_llama_dir, reference):
    """Run the workload twice on one engine: the second run hits the cache built under speculation
    (rejected drafts included) and must still produce the reference outputs."""
    llm = make_llm(tiny_llama_dir, max_model_len=512, kv_cache_memory=8 * 2**20,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts, params = workload(0)
    extended = [p + o.token_ids[:17] for p, o in zip(prompts, reference)]  # prompts that reach into outputs
    first = run(llm, prompts, params)
    second = run(llm, extended, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(prompts))
    assert llm.engine.core.kv_cache.num_hit_tokens > 0
    plain = run(make_llm(tiny_llama_dir, max_model_len=512, kv_cache_memory=8 * 2**20, enable_prefix_caching=False),
                extended, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * len(prompts))
    assert [o.token_ids for o in first] == [o.token_ids for o in reference]
    assert [o.token_ids for o in second] == [o.token_ids for o in plain]
    assert_idle(llm)


@pytest.mark.slow
def test_smollm2_greedy_identical_with_ngram_and_draft(smollm2_dir, tmp_path):
    text = ("Copy this list exactly: apples, pears, plums, apples, pears, plums, apples, pears, plums. "
            "Copy: apples, pears,")
    draft = write_truncated_draft(smollm2_dir, tmp_path / "draft", 6)
    plain = make_llm(smollm2_dir, quantization="none", max_model_len=256, kv_cache_memory=64 * 2**20)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [text, "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib("]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}):
        llm = make_llm(smollm2_dir, quantization="none", max_model_len=256, kv_cache_memory=96 * 2**20,
                       speculative_config=spec)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, spec["method"]
        assert llm.engine.core.spec_stats.num_accepted_tokens > 0
        assert_idle(llm)


CHI2_P001_DF8 = 26.12


@pytest.fixture(scope="module")
def tiny_noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny target with noise on its output head: q close to p but not equal, so drafts are
    sometimes accepted and sometimes rejected (the 1-layer draft's top tokens are all different)."""
    import shutil
    from safetensors.torch import load_file, save_file
    folder = tmp_path_factory.mktemp("tiny-noisy-draft")
    for file in tiny_llama_dir.iterdir():
        if file.suffix == ".json":
            shutil.copy(file, folder / file.name)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    head = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = head + 0.5 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.slow
def test_sampled_pairs_follow_the_target_distribution(tiny_llama_dir, tiny_noisy_draft_dir):
    """Token 2 of each request comes out of verification (a perturbed draft, so q != p): the joint
    frequencies of (token 1, token 2) must match the target's own p(t1) p(t2 | t1)."""
    from transformers import AutoModelForCausalLM
    prompt, draws = [1, 500, 600, 700], 3000
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    llm = make_llm(tiny_llama_dir, max_model_len=64, kv_cache_memory=16 * 2**20, seed=3,
                   speculative_config={"method": "draft_model", "model": str(tiny_noisy_draft_dir),
                                       "num_speculative_tokens": 2})
    outs = llm.generate([{"prompt_token_ids": prompt}] * draws, params, use_tqdm=False)
    spec = llm.engine.core.spec_stats
    assert spec.num_drafts >= draws and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    top3 = lambda ids: (lambda v: (v.indices.tolist(), v.values.softmax(-1).tolist()))(
        hf(torch.tensor([ids])).logits[0, -1].topk(3))
    expected = {}
    with torch.no_grad():
        for t1, p1 in zip(*top3(prompt)):
            for t2, p2 in zip(*top3(prompt + [t1])):
                expected[(t1, t2)] = p1 * p2
    counts = {}
    for out in outs:
        pair = tuple(out.outputs[0].token_ids[:2])
        assert pair in expected, f"sampled {pair} outside the top-3 support"
        counts[pair] = counts.get(pair, 0) + 1
    stat = sum((counts.get(pair, 0) - p * draws) ** 2 / (p * draws) for pair, p in expected.items())
    assert stat < CHI2_P001_DF8, stat
    assert_idle(llm)


def test_seeded_request_with_speculation_ignores_its_neighbours(tiny_llama_dir, tiny_draft_dir):
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3}
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    alone = make_llm(tiny_llama_dir, max_model_len=128, kv_cache_memory=16 * 2**20, speculative_config=spec)
    [expected] = alone.generate([prompt], seeded, use_tqdm=False)
    crowd = make_llm(tiny_llama_dir, max_model_len=128, kv_cache_memory=16 * 2**20, speculative_config=spec, seed=9)
    others = [SamplingParams(max_tokens=20, temperature=t, ignore_eos=True) for t in (0, 1.0, 0.5, 0)]
    prompts = [{"prompt_token_ids": [100 + i] * (3 + i)} for i in range(4)]
    outs = crowd.generate(prompts[:2] + [prompt] + prompts[2:], others[:2] + [seeded] + others[2:], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == expected.outputs[0].token_ids
    assert_idle(crowd)
