"""Mixture-of-experts families serve token-identical to transformers (fp32, CPU greedy).

For each of Mixtral, Qwen3-MoE and OLMoE a tiny random model (8 experts, top-2) is saved as a real
safetensors folder -- Mixtral and Qwen3-MoE in the per-expert layout that published checkpoints and
``save_pretrained`` use, OLMoE in transformers 5's stacked layout -- and served with chunked prefill,
shared prefixes (cache hits), a KV cache too small for the batch (preemption) and n > 1. transformers
runs its per-expert ("eager") experts loop as the oracle; a hook on its routers checks that the
tokens reach every expert of every sparse layer, so no expert's weights go untested.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, copy_tokenizer, make_llm
from paged_runtime import SamplingParams

NUM_LAYERS, NUM_EXPERTS = 2, 8
COMMON = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
              max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, initializer_range=0.25,
              tie_word_embeddings=False, num_experts_per_tok=2)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(**COMMON, intermediate_size=48, num_key_value_heads=2, num_local_experts=NUM_EXPERTS)
    return MixtralForCausalLM(config), True


def qwen3_moe():
    """Layer 0 is dense (mlp_only_layers): the per-layer choice of MLP is exercised too."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(**COMMON, intermediate_size=160, moe_intermediate_size=48, num_key_value_heads=2,
                            head_dim=32, num_experts=NUM_EXPERTS, norm_topk_prob=True, mlp_only_layers=[0],
                            rope_theta=1000000.0)
    return Qwen3MoeForCausalLM(config), True


def olmoe():
    """clip_qkv 2.0 clamps a good share of q, k and v (their spread is ~2 here)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM
    config = OlmoeConfig(**COMMON, intermediate_size=48, num_key_value_heads=4, num_experts=NUM_EXPERTS,
                         clip_qkv=2.0, norm_topk_prob=False, pad_token_id=0)
    return OlmoeForCausalLM(config), False  # saved stacked: transformers 5's own layout


FAMILIES = {"MixtralForCausalLM": mixtral, "Qwen3MoeForCausalLM": qwen3_moe, "OlmoeForCausalLM": olmoe}


def spread_norms(model) -> None:
    """HF initialises norms to ones: spread them so a misplaced norm shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, smollm2_dir):
    """(architecture, folder, the transformers model loaded back from it)."""
    from transformers import AutoModelForCausalLM
    architecture = request.param
    folder = tmp_path_factory.mktemp(architecture)
    torch.manual_seed(0)
    model, per_expert_layout = FAMILIES[architecture]()
    spread_norms(model.to(torch.float32))
    model.save_pretrained(folder, safe_serialization=True, save_original_format=per_expert_layout)
    copy_tokenizer(smollm2_dir, folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager").eval()
    return architecture, folder, hf


def workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(3, 49152) for _ in range(40)]  # shared: later prompts hit the prefix cache
    prompts = [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (1, 9, 30, 77)]
    prompts += [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 3, 17, 64, 150)]
    max_tokens = [6 + (i * 5) % 13 for i in range(len(prompts))]
    return prompts, max_tokens


def hf_argmax_and_routes(hf, sequences: list[list[int]]) -> tuple[list[list[int]], dict[str, set[int]]]:
    """transformers' top token after every prefix of each sequence (one forward each), and the experts each
    sparse layer's router chose on the way."""
    routed: dict[str, set[int]] = {}
    hooks = [module.register_forward_hook(
        lambda m, args, out, name=name: routed.setdefault(name, set()).update(out[2].flatten().tolist()))
        for name, module in hf.named_modules() if name.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            tops = [hf(torch.tensor([seq])).logits[0].argmax(-1).tolist() for seq in sequences]
    finally:
        for hook in hooks:
            hook.remove()
    return tops, routed


def test_tiny_moe_matches_transformers(family):
    """Greedy identity, checked teacher-forced: each completion token must be transformers' top token after
    the prompt and the completion before it (by induction, exactly its greedy continuation), and a completion
    ends early only on EOS. One transformers forward per prompt instead of one per token keeps this quick."""
    architecture, folder, hf = family
    prompts, max_tokens = workload()
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    bytes_per_block = 2 * NUM_LAYERS * c.num_key_value_heads * head_dim * 4 * 16  # K and V, fp32, 16 tokens
    # 12 blocks of 16 tokens: far fewer than the batch needs at once (preemption by recompute);
    # a 48-token step budget: long prompts are prefilled in chunks beside running decodes.
    llm = make_llm(folder, max_model_len=192, max_num_batched_tokens=48, max_num_seqs=6,
                   kv_cache_memory=12 * bytes_per_block, block_size=16)
    core = llm.engine.core
    assert core.num_blocks == 12
    assert type(core.runner.model).__name__ == architecture
    params = [SamplingParams(max_tokens=m, temperature=0, n=2 if i % 3 == 0 else 1)
              for i, m in enumerate(max_tokens)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert core.kv_cache.num_hit_tokens > 0, "the shared prefix was meant to hit the cache"
    assert_idle(llm)

    completions = [out.outputs[0].token_ids for out in outs]
    tops, routed = hf_argmax_and_routes(hf, [p + list(t) for p, t in zip(prompts, completions)])
    for prompt, out, tokens, top, m, p in zip(prompts, outs, completions, tops, max_tokens, params):
        assert out.prompt_token_ids == prompt
        assert [o.token_ids for o in out.outputs] == [tokens] * p.n
        assert list(tokens) == top[len(prompt) - 1:-1], f"prompt of {len(prompt)} tokens diverged"
        assert len(tokens) == m or tokens[-1] == c.eos_token_id
    sparse_layers = NUM_LAYERS - (architecture == "Qwen3MoeForCausalLM")  # its layer 0 is dense
    assert len(routed) == sparse_layers
    assert all(experts == set(range(NUM_EXPERTS)) for experts in routed.values()), routed
