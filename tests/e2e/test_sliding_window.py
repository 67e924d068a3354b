"""Mistral's sliding window, served: token-identical to transformers past the window (fp32, CPU greedy).

A tiny random MistralForCausalLM with a 24-token window (every layer slides) and an explicit head_dim,
saved as a real safetensors folder with SmolLM2's tokenizer. Prompts run far past the window, with
chunked prefill, shared prefixes (cache hits), a KV cache too small for the batch (preemption) and
n > 1; the KV manager releases the blocks behind the window, so a long request holds fewer blocks
than its length needs. Transformers' output differs from a full-attention run of the same weights,
so the comparison can fail. Repeated with the compiled CPU kernels (the compiled decode step included); the Triton
backend is checked against the torch backend on a windowed model in tests/kernels/test_window_softcap.py
(its interpreter needs that folder's conftest without a GPU).
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, copy_tokenizer, count_decode_steps, hf_greedy, make_llm
from paged_runtime import SamplingParams
from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu

WINDOW, BLOCK, HEAD_DIM, NUM_LAYERS, NUM_KV_HEADS = 24, 16, 32, 2, 2
BYTES_PER_BLOCK = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4 * BLOCK  # K and V, fp32


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory, smollm2_dir):
    """As the tiny Llama (tests/conftest.py): large-std weights, norms spread, so the top token wins clearly."""
    from transformers import MistralConfig, MistralForCausalLM
    folder = tmp_path_factory.mktemp("tiny-mistral")
    config = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS,
                           num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                           max_position_embeddings=1024, sliding_window=WINDOW, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2, initializer_range=0.25)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(smollm2_dir, folder)
    return folder


@pytest.fixture(scope="module")
def mistral_hf(tiny_mistral_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32).eval()


def workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(11)
    system = [rng.randrange(3, 49152) for _ in range(40)]  # shared: later prompts hit the prefix cache
    prompts = [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (1, 30, 77)]
    prompts += [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 64, 260)]
    return prompts, [10 + (i * 7) % 25 for i in range(len(prompts))]


@pytest.fixture(scope="module")
def expected(mistral_hf):
    """Transformers' greedy tokens for (prompt, max_tokens), computed once each."""
    memo: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = hf_greedy(mistral_hf, prompt, max_tokens)
        return memo[key]
    return tokens


def test_transformers_applies_the_window(tiny_mistral_dir, expected):
    """Without this, identity below would not show that the window is served."""
    from transformers import AutoModelForCausalLM
    full = AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32, sliding_window=None).eval()
    assert full.config.sliding_window is None
    prompts, max_tokens = workload()
    assert any(hf_greedy(full, p, m) != expected(p, m) for p, m in zip(prompts, max_tokens))


def run_and_compare(model_dir, expected, **engine_kwargs):
    prompts, max_tokens = workload()
    # 10 blocks of 16 tokens (160 slots for 320-token requests: the window makes them enough), fewer than the
    # batch needs at once (preemption by recompute); a 48-token step budget: long prompts are prefilled in
    # chunks beside running decodes.
    llm = make_llm(model_dir, max_model_len=320, max_num_batched_tokens=48, max_num_seqs=16,
                   kv_cache_memory=10 * BYTES_PER_BLOCK, block_size=BLOCK, **engine_kwargs)
    core = llm.engine.core
    assert core.num_blocks == 10 and core.max_model_len == 320 and core.kv_cache.sliding_window == WINDOW
    most_held: dict[int, int] = {}  # by prompt length (the engine's request ids are its own)
    allocate = core.kv_cache.allocate_slots

    def recording(request, *args):
        ok = allocate(request, *args)
        held = sum(b is not None for b in core.kv_cache.tables.get(request.request_id, ()))
        most_held[request.num_prompt_tokens] = max(most_held.get(request.num_prompt_tokens, 0), held)
        return ok
    core.kv_cache.allocate_slots = recording
    params = [SamplingParams(max_tokens=m, temperature=0, n=3 if i % 3 == 0 else 1)
              for i, m in enumerate(max_tokens)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert core.kv_cache.num_hit_tokens > 0, "the shared prefix was meant to hit the cache"
    for prompt, out, m, p in zip(prompts, outs, max_tokens, params):
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.token_ids == expected(prompt, m), f"prompt of {len(prompt)} tokens diverged"
    longest = max(outs, key=lambda o: len(o.prompt_token_ids))
    length = len(longest.prompt_token_ids) + len(longest.outputs[0].token_ids)
    assert most_held[len(longest.prompt_token_ids)] < -(-length // BLOCK), "the blocks behind the window were kept"
    assert_idle(llm)
    return llm


def test_tiny_mistral_matches_transformers_past_the_window(tiny_mistral_dir, expected):
    llm = run_and_compare(tiny_mistral_dir, expected)
    assert llm.engine.core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert llm.engine.core.runner.model.config.architecture == "MistralForCausalLM"


@pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")
def test_tiny_mistral_with_cpu_kernels(tiny_mistral_dir, expected, monkeypatch):
    steps = count_decode_steps(monkeypatch)
    llm = run_and_compare(tiny_mistral_dir, expected, device="cpu", cpu_kernels=True)  # "auto" is CUDA on a GPU
    assert llm.engine.core.ops.name == "cpu-kernels" and llm.engine.core.attention_backend == "cpu"
    runner = llm.engine.core.runner
    plan = runner.cpu_plans[runner.model]
    assert steps and {layer.window for layer in plan.stack.layers} == {WINDOW}  # the compiled step ran, sliding
