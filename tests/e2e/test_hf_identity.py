"""Greedy outputs are token-identical to Hugging Face transformers (fp32, CPU).

The engine runs with a small token budget (chunked prefill mixed with
decodes) and a KV cache too small for all requests at once (preemption by
recompute), so every scheduling path is on the line.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(count: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths[:count]]


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_tiny_llama_matches_transformers_with_chunking_and_preemption(tiny_llama_dir, tiny_hf):
    lengths = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 128, 129, 200, 255, 300, 377, 450, 511, 600, 5, 48]
    prompts = random_prompts(len(lengths), lengths, seed=1)
    max_tokens = [8 + (i * 7) % 40 for i in range(len(prompts))]
    # 64 blocks of 16 = 1,024 slots: far less than the ~6,000 the batch needs at once.
    llm = make_llm(tiny_llama_dir, max_model_len=1024, max_num_batched_tokens=96, max_num_seqs=8,
                   kv_cache_memory=64 * 16 * (2 * 2 * 2 * 16 * 4), block_size=16)  # blocks * tokens * bytes per token
    assert llm.engine.core.num_blocks == 64
    params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    for prompt, out, m in zip(prompts, outs, max_tokens):
        expected = hf_greedy(tiny_hf, prompt, m)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    assert_idle(llm)


def test_unchunked_batch_with_small_decode_groups(tiny_llama_dir, tiny_hf, monkeypatch):
    from paged_runtime.attention import torch_backend
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_SIZE", 2)  # several ragged groups per step
    prompts = random_prompts(6, [40, 90, 3, 250, 17, 130], seed=2)
    llm = make_llm(tiny_llama_dir, max_model_len=512, max_num_batched_tokens=2048, kv_cache_memory=8 * 2**20,
                   attention_backend="torch")  # the gathered decode groups (the CPU kernels need none)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_hf, prompt, 24)
    assert_idle(llm)


def test_long_prefill_threshold_chunks_prompts_beside_decodes_and_keeps_the_tokens(tiny_llama_dir, tiny_hf,
                                                                                    monkeypatch):
    prompts = random_prompts(4, [300, 5, 120, 17], seed=3)
    llm = make_llm(tiny_llama_dir, max_model_len=512, long_prefill_token_threshold=40, kv_cache_memory=8 * 2**20)
    scheduler, chunks = llm.engine.core.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend(s.num_new_tokens for s in out.scheduled)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0),
                        use_tqdm=False)
    assert max(chunks) == 40 and chunks.count(40) == 7 + 3  # 300 = 7 x 40 + 20 and 120 = 3 x 40, in 2048's budget
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_hf, prompt, 24)
    assert_idle(llm)
    with pytest.raises(ValueError, match=r"^long_prefill_token_threshold \(513\) cannot be greater than "
                                         r"max_model_len \(512\)$"):
        make_llm(tiny_llama_dir, max_model_len=512, long_prefill_token_threshold=513)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # quantization="none": the file's dequantized weights, the ones transformers loads (the GGUF's own blocks
    # have their tests in test_gguf_blocks_served.py and test_quantization.py).
    llm = make_llm(smollm2_dir, quantization="none", max_model_len=128, max_num_batched_tokens=24, max_num_seqs=4,
                   kv_cache_memory=10 * 16 * (2 * 30 * 3 * 64 * 4))  # 10 blocks: forces preemption
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
             "List three colors:", "Water boils at a temperature of 100 degrees Celsius, which is"]
    prompts = [tokenizer.encode(t) for t in texts]
    outs = llm.generate(texts, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert_idle(llm)
