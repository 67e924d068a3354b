"""Qwen3 (dense) serves token-identical to transformers (fp32, CPU greedy).

A tiny random Qwen3 with an explicit head_dim (32, not hidden / heads = 16) and tied embeddings, saved
as a real safetensors folder: the per-head q/k RMSNorm before RoPE must be right to the bit for greedy
tokens to agree. The engine runs with chunked prefill, shared prefixes (cache hits), a KV cache too
small for the batch (preemption) and n > 1 -- and once more with the compiled CPU kernels forced on,
whose compiled decode step runs Qwen3's q/k norms from its layer description.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tests.conftest import assert_idle, copy_tokenizer, count_decode_steps, hf_greedy, make_llm
from paged_runtime import SamplingParams
from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.models import registry

HEAD_DIM, NUM_LAYERS, NUM_KV_HEADS = 32, 2, 2
BYTES_PER_BLOCK = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4 * 16  # K and V, fp32, 16 tokens


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory, smollm2_dir):
    """As the tiny Llama (tests/conftest.py): large-std weights so the top token wins clearly."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=1024, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.25)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # HF initialises the norms to ones: spread them so a wrong q/k norm shows
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(smollm2_dir, folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_hf(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(3, 49152) for _ in range(40)]  # shared: later prompts hit the prefix cache
    prompts = [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (1, 9, 30, 77)]
    prompts += [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 3, 17, 64, 150, 260)]
    max_tokens = [10 + (i * 7) % 25 for i in range(len(prompts))]
    return prompts, max_tokens


def run_and_compare(model_dir, hf, **engine_kwargs):
    prompts, max_tokens = workload()
    # 20 blocks of 16 tokens: far fewer than the batch needs at once (preemption by recompute);
    # a 48-token step budget: long prompts are prefilled in chunks beside running decodes.
    llm = make_llm(model_dir, max_model_len=320, max_num_batched_tokens=48, max_num_seqs=6,
                   kv_cache_memory=20 * BYTES_PER_BLOCK, block_size=16, **engine_kwargs)
    assert llm.engine.core.num_blocks == 20
    params = [SamplingParams(max_tokens=m, temperature=0, n=2 if i % 3 == 0 else 1)
              for i, m in enumerate(max_tokens)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert core.kv_cache.num_hit_tokens > 0, "the shared prefix was meant to hit the cache"
    for prompt, out, m, p in zip(prompts, outs, max_tokens, params):
        expected = hf_greedy(hf, prompt, m)
        assert out.prompt_token_ids == prompt
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    assert_idle(llm)
    return llm


def test_tiny_qwen3_matches_transformers(tiny_qwen3_dir, qwen3_hf):
    llm = run_and_compare(tiny_qwen3_dir, qwen3_hf)
    model = llm.engine.core.runner.model
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # tied


@pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")
def test_tiny_qwen3_with_cpu_kernels_runs_its_q_k_norms_in_the_compiled_decode_step(tiny_qwen3_dir, qwen3_hf,
                                                                                   monkeypatch):
    """transformers' tokens, with every decode step of the layers as one C call (the q/k norms described)."""
    steps = count_decode_steps(monkeypatch)
    llm = run_and_compare(tiny_qwen3_dir, qwen3_hf, device="cpu", cpu_kernels=True)  # "auto" is CUDA on a GPU
    assert llm.engine.core.ops.name == "cpu-kernels"
    assert steps and all(layers == 2 for layers, _ in steps)


def write_config(src, dst, **changes) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))


def test_qwen3_with_sliding_window_is_refused_at_start_up(tiny_qwen3_dir, tmp_path):
    folder = tmp_path / "sliding"
    write_config(tiny_qwen3_dir, folder, use_sliding_window=True, sliding_window=64)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM with use_sliding_window=true is not supported: "
                                         "attention here is full-context"):
        make_llm(folder, max_model_len=128)


def test_an_unsupported_architecture_is_refused_with_the_supported_list(tiny_qwen3_dir, tmp_path):
    folder = tmp_path / "gpt2"
    write_config(tiny_qwen3_dir, folder, architectures=["GPT2LMHeadModel"])
    assert "Qwen3ForCausalLM" in registry.architectures()
    with pytest.raises(ValueError) as info:
        make_llm(folder, max_model_len=128)
    assert str(info.value) == ("unsupported architecture 'GPT2LMHeadModel'; supported: "
                               "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                               "Gemma3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, "
                               "Phi3ForCausalLM, BertModel")


def test_a_published_qwen3_config_reads_as_its_shape():
    """Qwen3-0.6B's config.json as published (transformers 4.x keys): head_dim 128 though 1024 / 16 = 64."""
    from paged_runtime.models.config import ModelConfig
    raw = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
           "eos_token_id": 151645, "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
           "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
           "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
           "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "use_sliding_window": False, "vocab_size": 151936}
    c = ModelConfig.from_dict(raw)
    assert (c.head_dim, c.num_heads, c.num_kv_heads) == (128, 16, 8)
    assert (c.attention_bias, c.tie_word_embeddings) == (False, True)
    assert (c.rope_theta, c.rope_scaling, c.sliding_window, c.rms_norm_eps) == (1000000, None, None, 1e-06)
