"""Gemma 3 (text) serves token-identical to transformers (fp32, CPU greedy).

A tiny random Gemma3ForCausalLM saved as a real safetensors folder: local (sliding-window, 20 tokens) and
global layers interleaved, each kind with its own RoPE base; head_dim 32 with query_pre_attn_scalar 24 (so the
attention scale is not head_dim's); every RMSNorm weight spread (HF's are zeros: 1 + w would hide a missing +1
or a norm in the wrong place). Prompts run to 260 tokens, far past the window; the engine runs with chunked
prefill, shared prefixes (cache hits), a KV cache too small for the batch (preemption) and n > 1 -- on
PyTorch's ops and attention, and once more with the compiled CPU kernels forced on.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, copy_tokenizer, count_decode_steps, hf_greedy, make_llm
from paged_runtime import SamplingParams
from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.gemma3 import gemma3_rope

HEAD_DIM, NUM_KV_HEADS, WINDOW = 32, 2, 20
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
BYTES_PER_BLOCK = 2 * len(LAYER_TYPES) * NUM_KV_HEADS * HEAD_DIM * 4 * 16  # K and V, fp32, 16 tokens


def save_tiny_gemma3(folder, smollm2_dir, **changes) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    settings = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=len(LAYER_TYPES),
                    num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    layer_types=LAYER_TYPES, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=1024,
                    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.25)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**settings, **changes})).to(torch.float32)
    with torch.no_grad():  # HF initialises Gemma's norms to zeros (a scale of 1 + 0): spread them
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(smollm2_dir, folder)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, smollm2_dir):
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    save_tiny_gemma3(folder, smollm2_dir)
    return folder


def load_hf(folder, **changes):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **changes).eval()


def workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(3, 49152) for _ in range(40)]  # shared: later prompts hit the prefix cache
    prompts = [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (1, 9, 30, 77)]
    prompts += [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 3, 17, 64, 150, 260)]
    max_tokens = [10 + (i * 7) % 25 for i in range(len(prompts))]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def expected_tokens(tiny_gemma3_dir) -> list[list[int]]:
    """transformers' greedy completions of the workload (computed once for the module's engine runs)."""
    hf = load_hf(tiny_gemma3_dir)
    return [hf_greedy(hf, prompt, m) for prompt, m in zip(*workload())]


def run_and_compare(model_dir, expected_tokens, **engine_kwargs):
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
    for prompt, out, expected, p in zip(prompts, outs, expected_tokens, params):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    assert_idle(llm)
    return llm


def test_tiny_gemma3_matches_transformers(tiny_gemma3_dir, expected_tokens):
    # PyTorch ops and attention on every machine (the oracle path; auto would pick the CPU kernels on an
    # AVX-512 CPU, Triton on a GPU): the kernel backends are tested below.
    llm = run_and_compare(tiny_gemma3_dir, expected_tokens, device="cpu", cpu_kernels=False)
    model = llm.engine.core.runner.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # tied
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [WINDOW, WINDOW, None, WINDOW]
    assert model.layers[0].self_attn.attn.scale == 24 ** -0.5


@pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")
@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_tiny_gemma3_with_cpu_kernels(tiny_gemma3_dir, expected_tokens, attention, monkeypatch):
    """The kernel op set gives transformers' tokens. With the kernel backend every decode step runs the layers
    as one C call: Gemma's four (1 + w) norms, q/k norms, GeGLU and each layer kind's RoPE tables described;
    with the torch backend (no compiled decode step) its per-op path."""
    steps = count_decode_steps(monkeypatch)
    llm = run_and_compare(tiny_gemma3_dir, expected_tokens, device="cpu", cpu_kernels=True,
                          attention_backend=attention)
    assert (llm.engine.core.ops.name, llm.engine.core.attention_backend) == ("cpu-kernels", attention)
    assert bool(steps) == (attention == "cpu") and all(layers == 4 for layers, _ in steps)


def test_the_window_changes_the_reference(tiny_gemma3_dir):
    """Without its window the same model answers otherwise on long prompts: the identity above needs it."""
    windowed, unwindowed = load_hf(tiny_gemma3_dir), load_hf(tiny_gemma3_dir, sliding_window=4096)
    prompts, _ = workload()
    long_prompts = [p for p in prompts if len(p) > 2 * WINDOW]
    assert any(hf_greedy(windowed, p, 8) != hf_greedy(unwindowed, p, 8) for p in long_prompts)


def test_soft_caps_as_transformers(tmp_path, smollm2_dir):
    """final_logit_softcapping squeezes the logits (logprobs show it); attn_logit_softcapping is stored but
    never applied by transformers' Gemma 3 (nor here): the reference is the same with and without it."""
    folder = tmp_path / "capped"
    save_tiny_gemma3(folder, smollm2_dir, attn_logit_softcapping=20.0, final_logit_softcapping=3.0)
    hf = load_hf(folder)
    prompt = workload()[0][-1][:60]
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
        uncapped = load_hf(folder, attn_logit_softcapping=None)(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert torch.equal(reference, uncapped)
    assert (reference.amax(-1) - reference.amin(-1)).max() <= 2 * 3.0 + 1e-4  # the final cap is in force
    llm = make_llm(folder, max_model_len=128)
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, logprobs=3,
                                                                        prompt_logprobs=0), use_tqdm=False)
    for position in range(1, len(prompt)):
        value = out.prompt_logprobs[position][prompt[position]].logprob
        assert abs(value - reference[position - 1, prompt[position]].item()) < 1e-4
    token = out.outputs[0].token_ids[0]
    assert abs(out.outputs[0].logprobs[0][token].logprob - reference[-1].max().item()) < 1e-4


def test_a_published_gemma3_1b_config_reads_as_its_shape():
    """google/gemma-3-1b-it's config.json (transformers 4.50 keys): five local layers (window 512, RoPE base
    1e4) to one global (1e6); no tie_word_embeddings key, yet tied."""
    raw = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
           "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
           "intermediate_size": 6912,
           "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
           "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
           "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
           "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
           "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
    c = ModelConfig.from_dict(raw)
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.vocab_size) == (1152, 6912, 26, 262144)
    assert (c.head_dim, c.num_heads, c.num_kv_heads, c.tie_word_embeddings) == (256, 4, 1, True)
    assert c.layer_windows == tuple(None if i % 6 == 5 else 512 for i in range(26))
    assert (c.rope_theta, c.rope_scaling, c.sliding_window, c.max_position_embeddings) == (1000000, None, None, 32768)
    assert gemma3_rope(raw) == {"full_attention": (1000000, None), "sliding_attention": (10000, None)}


def test_gemma3_rope_reads_both_spellings_of_global_scaling():
    """The 4B+ text models scale global RoPE linearly by 8: 4.x keys, and transformers 5's per-kind dict."""
    old = {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    new = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    for raw in (old, new):
        rope = gemma3_rope(raw)
        assert rope["sliding_attention"] == (1e4, None)
        base, scaling = rope["full_attention"]
        assert base == 1e6 and (scaling["rope_type"], scaling["factor"]) == ("linear", 8.0)


def test_a_bidirectional_gemma3_is_refused():
    raw = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 1, "use_bidirectional_attention": True}
    with pytest.raises(ValueError, match="use_bidirectional_attention=true"):
        ModelConfig.from_dict(raw)

