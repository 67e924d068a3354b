"""Prefix caching never changes greedy output, even when cached blocks are evicted and reused."""
from __future__ import annotations

import random

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 49152) for _ in range(70)]
    other = [rng.randrange(3, 49152) for _ in range(33)]
    tails = [[rng.randrange(3, 49152) for _ in range(rng.randrange(1, 40))] for _ in range(10)]
    return [system + t for t in tails[:6]] + [other + t for t in tails[6:]] + [system[:48], system]


def test_outputs_identical_with_and_without_prefix_caching(tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(3)]
    params = SamplingParams(max_tokens=20, temperature=0)
    # 24 blocks: too few to keep every prefix, so cached blocks are evicted and reused.
    common = dict(max_model_len=384, max_num_batched_tokens=64, max_num_seqs=4,
                  kv_cache_memory=24 * 16 * (2 * 2 * 2 * 16 * 4))
    cached = make_llm(tiny_llama_dir, enable_prefix_caching=True, **common)
    plain = make_llm(tiny_llama_dir, enable_prefix_caching=False, **common)
    first = cached.generate(prompts, params, use_tqdm=False)
    again = cached.generate(prompts[::-1], params, use_tqdm=False)[::-1]
    reference = plain.generate(prompts, params, use_tqdm=False)
    kv = cached.engine.core.kv_cache
    assert kv.num_hit_tokens > 0 and plain.engine.core.kv_cache.num_hit_tokens == 0
    for a, b, ref in zip(first, again, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref.outputs[0].token_ids
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_idle(cached)
    assert_idle(plain)
    cached.reset_prefix_cache()
    assert not kv.pool.cached
