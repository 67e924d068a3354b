"""Phi-3 / Phi-3.5 / Phi-4-mini (``Phi3ForCausalLM``) serve token-identical to transformers (fp32, CPU greedy).

Two tiny random Phi-3s saved as real safetensors folders, fused ``qkv_proj`` and ``gate_up_proj`` as
transformers saves them:

- plain: whole-head RoPE and a 48-token ``sliding_window`` (transformers masks every layer with it), on
  prompts longer than the window;
- Phi-4-mini-like: ``partial_rotary_factor`` 0.75 and LongRoPE with distinct short and long factors,
  original length 64 of 256. Prompts longer than 64 are rotated long throughout; shorter ones short until
  they grow past 64 tokens, where transformers' generate drops its cache and recomputes everything long
  (the scheduler recomputes them too). Long and short prompts share a prefix, which must not be served
  from each other's cached blocks.

The engine runs with chunked prefill, shared prefixes (cache hits), a KV cache too small for the batch
(preemption) and n > 1.
"""
from __future__ import annotations

import functools
import math
import random
import shutil

import pytest
import torch

from tests.conftest import assert_idle, copy_tokenizer, count_decode_steps, hf_greedy, make_llm
from paged_runtime import SamplingParams
from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.models.config import ModelConfig

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16
BYTES_PER_BLOCK = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4 * 16  # K and V, fp32, 16 tokens
ORIGINAL_MAX = 64
SHORT_FACTOR = [1.0, 1.3, 1.8, 2.5, 3.5, 5.0]  # rotary_dim 12 = 16 * 0.75: 6 frequencies
LONG_FACTOR = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
ATTENTION_FACTOR = math.sqrt(1 + math.log(256 / ORIGINAL_MAX) / math.log(ORIGINAL_MAX))  # transformers' default


def longrope(short, long) -> dict:
    return {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long)}


def phi3_config(**changes):
    from transformers import Phi3Config
    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=NUM_LAYERS,
                  num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, max_position_embeddings=1024,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, initializer_range=0.25)
    return Phi3Config(**(kwargs | changes))


def save_tiny_phi3(folder, smollm2_dir, config):
    """Wide-spread weights (norms too, HF starts them at ones) so the top token wins clearly."""
    from transformers import Phi3ForCausalLM
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(smollm2_dir, folder)
    return folder


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, smollm2_dir):
    return save_tiny_phi3(tmp_path_factory.mktemp("tiny-phi3"), smollm2_dir, phi3_config(sliding_window=48))


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory, smollm2_dir):
    config = phi3_config(max_position_embeddings=256, original_max_position_embeddings=ORIGINAL_MAX,
                         partial_rotary_factor=0.75, rope_scaling=longrope(SHORT_FACTOR, LONG_FACTOR))
    return save_tiny_phi3(tmp_path_factory.mktemp("tiny-phi3-longrope"), smollm2_dir, config)


@functools.cache
def hf_model(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def workload(which=range(9)) -> tuple[list[list[int]], list[int]]:
    """Prompts of 41, 49 (grows to 66: past 64), 70, 117 tokens sharing a 40-token prefix; 1, 3, 17, 64
    (grows to 98) and 150 on their own; ``which`` of them."""
    rng = random.Random(7)
    system = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (1, 9, 30, 77)]
    prompts += [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 3, 17, 64, 150)]
    max_tokens = [10 + (i * 7) % 25 for i in range(len(prompts))]
    return [prompts[i] for i in which], [max_tokens[i] for i in which]


@functools.cache
def hf_expected(model_dir, i: int) -> list[int]:
    """transformers' greedy tokens for prompt ``i`` of the workload (each computed once per module)."""
    (prompt,), (max_tokens,) = workload([i])
    return hf_greedy(hf_model(model_dir), prompt, max_tokens)


def run_and_compare(model_dir, which=tuple(range(9)), num_blocks=20, **engine_kwargs):
    prompts, max_tokens = workload(which)
    # 20 blocks of 16 tokens: far fewer than the batch needs at once (preemption by recompute);
    # a 48-token step budget: long prompts are prefilled in chunks beside running decodes.
    llm = make_llm(model_dir, max_model_len=256, max_num_batched_tokens=48, max_num_seqs=6,
                   kv_cache_memory=num_blocks * BYTES_PER_BLOCK, block_size=16, **engine_kwargs)
    assert llm.engine.core.num_blocks == num_blocks
    params = [SamplingParams(max_tokens=m, temperature=0, n=2 if i % 3 == 0 else 1)
              for i, m in enumerate(max_tokens)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert core.kv_cache.num_hit_tokens > 0, "the shared prefix was meant to hit the cache"
    expected = [hf_expected(model_dir, i) for i in which]
    for prompt, out, p, tokens in zip(prompts, outs, params, expected):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
    assert_idle(llm)
    return llm


def test_tiny_phi3_with_a_sliding_window_matches_transformers(plain_dir):
    # Prompts of 41 .. 150 tokens. With the window on every layer a request holds at most 7 blocks (the
    # KV manager releases those behind it), so 20 would never run short: 9 do.
    llm = run_and_compare(plain_dir, (0, 2, 3, 5, 8), num_blocks=9, attention_backend="torch")
    model = llm.engine.core.runner.model
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert model.config.layer_windows == (48, 48)


def test_tiny_phi3_with_partial_rotary_and_longrope_matches_transformers(longrope_dir):
    hf = hf_model(longrope_dir)
    assert hf.model.rotary_emb.inv_freq.shape == (6,)  # transformers rotates 12 of 16 dims too
    llm = run_and_compare(longrope_dir, cpu_kernels=False, attention_backend="torch")
    model = llm.engine.core.runner.model
    assert model.rotary.rotary_dim == 12 and model.rotary.cos.shape == (2 * 256, 12)
    assert llm.engine.core.scheduler.rope_switch == ORIGINAL_MAX
    # The factors matter: transformers with them swapped differs on a long prompt; one that never switches
    # (same attention factor) agrees on a short prompt until it grows past the original length, then differs.
    from transformers import AutoModelForCausalLM
    prompts, max_tokens = workload()
    expected = [hf_expected(longrope_dir, i) for i in range(len(prompts))]
    swapped = phi3_config(max_position_embeddings=256, original_max_position_embeddings=ORIGINAL_MAX,
                          partial_rotary_factor=0.75, rope_scaling=longrope(LONG_FACTOR, SHORT_FACTOR))
    other = AutoModelForCausalLM.from_pretrained(longrope_dir, config=swapped, dtype=torch.float32).eval()
    assert hf_greedy(other, prompts[2], max_tokens[2]) != expected[2]  # 70 tokens: long throughout
    never = phi3_config(max_position_embeddings=256, original_max_position_embeddings=256, partial_rotary_factor=0.75,
                        rope_scaling=longrope(SHORT_FACTOR, LONG_FACTOR) | {"attention_factor": ATTENTION_FACTOR})
    other = AutoModelForCausalLM.from_pretrained(longrope_dir, config=never, dtype=torch.float32).eval()
    grown = hf_greedy(other, prompts[1], max_tokens[1])  # 49 tokens growing to 66
    assert grown[:ORIGINAL_MAX - 49] == expected[1][:ORIGINAL_MAX - 49] and grown != expected[1]


@pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")
def test_tiny_phi3_longrope_with_cpu_kernels_runs_the_compiled_decode_step(longrope_dir, monkeypatch):
    """Partial rotary (12 of 16 dims) and LongRoPE's stacked tables, read by the step's rope positions (short
    prompts switching to the long half as they grow) in the one C call: transformers' tokens."""
    steps = count_decode_steps(monkeypatch)
    llm = run_and_compare(longrope_dir, (0, 1, 2, 7, 8), device="cpu", cpu_kernels=True)
    assert llm.engine.core.ops.name == "cpu-kernels" and steps


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_checkpoint_tensors_load_into_each_tensor_parallel_ranks_shards(plain_dir, rank):
    """qkv_proj's q, k and v rows and gate_up_proj's gate and up rows are each split over 2 ranks by heads."""
    from safetensors.torch import load_file
    from paged_runtime.layers.linear import TensorParallel
    from paged_runtime.models.phi3 import Phi3ForCausalLM
    model = Phi3ForCausalLM(ModelConfig.from_folder(plain_dir), 64, torch.float32, torch.device("cpu"),
                            tp=TensorParallel(rank, 2))
    (weights,) = plain_dir.glob("*.safetensors")
    tensors = load_file(weights)
    assert {model.load_weight(name, t) for name, t in tensors.items()} - {None} == model.expected_weights()
    half = lambda t: t.chunk(2)[rank]
    q, k, v = tensors["model.layers.1.self_attn.qkv_proj.weight"].split([64, 32, 32])  # 4 heads, 2 KV heads
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, torch.cat([half(q), half(k), half(v)]))
    gate, up = tensors["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, torch.cat([half(gate), half(up)]))


def test_fused_checkpoint_tensors_of_the_wrong_size_are_refused(plain_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "bad"
    shutil.copytree(plain_dir, folder)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="qkv_proj.weight has 112 rows, expected 128"):
        make_llm(folder, max_model_len=128, attention_backend="torch")


# Published config.json shapes (keys as on the Hub; factor lists shortened to their lengths' worth).
PHI35_MINI = {"architectures": ["Phi3ForCausalLM"], "bos_token_id": 1, "eos_token_id": 32000, "hidden_act": "silu",
              "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
              "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
              "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
              "rope_scaling": {"long_factor": [1.08] * 48, "short_factor": [1.0] * 48, "type": "longrope"},
              "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "vocab_size": 32064}
PHI4_MINI = {"architectures": ["Phi3ForCausalLM"], "bos_token_id": 199999, "eos_token_id": 199999,
             "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
             "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 131072, "mlp_bias": False,
             "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
             "rms_norm_eps": 1e-05,
             "rope_scaling": {"long_factor": [1.0] * 48, "short_factor": [1.0] * 48, "type": "longrope"},
             "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True,
             "torch_dtype": "bfloat16", "vocab_size": 200064}


def test_published_phi35_and_phi4_mini_configs_read_as_their_shapes():
    c = ModelConfig.from_dict(PHI35_MINI)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (3072, 32, 32, 32, 96)
    assert (c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (8192, 32064, False)
    assert c.rope_scaling["rope_type"] == "longrope" and "partial_rotary_factor" not in c.rope_scaling
    assert (c.rope_scaling["original_max_position_embeddings"], c.rope_scaling["factor"]) == (4096, 32.0)
    assert c.layer_windows == () and c.sliding_window is None  # 262144 > 131072: no position is masked
    c = ModelConfig.from_dict(PHI4_MINI)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (3072, 32, 24, 8, 128)
    assert (c.vocab_size, c.tie_word_embeddings) == (200064, True)
    assert c.rope_scaling["partial_rotary_factor"] == 0.75 and c.rope_scaling["rope_type"] == "longrope"


def test_phi3_mini_4k_slides_every_layer_and_early_su_scaling_is_longrope():
    c = ModelConfig.from_dict(PHI35_MINI | {"max_position_embeddings": 4096, "sliding_window": 2047,
                                            "rope_scaling": None})
    assert c.layer_windows == (2047,) * 32 and c.rope_scaling is None
    c = ModelConfig.from_dict(PHI35_MINI | {"rope_scaling": {"type": "su", "long_factor": [1.0] * 48,
                                                             "short_factor": [1.0] * 48}})
    assert c.rope_scaling["rope_type"] == "longrope"


def test_a_request_growing_past_the_longrope_switch_is_recomputed_long_apart_from_short_blocks():
    """Scheduler alone (switch 8, blocks of 4): a prompt over 8 tokens is salted long at once; a shorter one
    is recomputed from scratch (not counted as a preemption) when it grows past 8, salted long, and may
    then start from a long request's cached blocks of the same tokens."""
    from paged_runtime.core.kv_cache_manager import KVCacheManager
    from paged_runtime.core.scheduler import Scheduler
    from paged_runtime.request import Request, RequestStatus
    scheduler = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=100, rope_switch=8)
    for request_id, n, arrival in (("short", 6, 0), ("long", 9, 1)):
        scheduler.add_request(Request(request_id, list(range(10, 10 + n)), SamplingParams(max_tokens=20), arrival,
                                      max_tokens=20))
    short, long = scheduler.requests["short"], scheduler.requests["long"]
    assert (short.cache_salt, long.cache_salt) == (None, "\0long rope")

    def step() -> dict[str, int]:
        out = scheduler.schedule()
        scheduler.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
        scheduler.check_invariants()
        return {s.request_id: s.num_new_tokens for s in out.scheduled}

    assert step() == {"short": 6, "long": 9}
    assert step() == {"short": 1, "long": 1}  # short: 8 tokens now, still short
    assert short.status == RequestStatus.RUNNING
    assert step() == {"short": 1, "long": 1}  # short: 9 tokens: its KV must be rotated long
    assert (short.status, short.num_computed_tokens, short.cache_salt) == (RequestStatus.WAITING, 0, "\0long rope")
    assert step() == {"long": 1, "short": 9 - 4}  # its first block [10..13] is long's, cached
    assert scheduler.num_preemptions == 0


def test_every_phi3_describes_its_window_rotary_width_and_tables():
    """What the compiled decode step needs of Phi-3's variants is in the layer description: the window, the
    rotated width (partial rotary) and LongRoPE's stacked short and long tables."""
    from paged_runtime.models.phi3 import Phi3ForCausalLM
    tiny = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 256}
    rope = {"rope_scaling": longrope([1.0] * 8, [2.0] * 8), "original_max_position_embeddings": 64}
    for changes, (window, rot, rows) in (({}, (None, 16, 64)), ({"sliding_window": 32}, (32, 16, 64)),
                                         ({"partial_rotary_factor": 0.5}, (None, 8, 64)), (rope, (None, 16, 128))):
        model = Phi3ForCausalLM(ModelConfig.from_dict(tiny | changes), 64, torch.float32, torch.device("cpu"))
        [layer] = model.describe_decoder_layers()
        assert (layer.window, layer.rot, layer.cos.shape) == (window, rot, (rows, rot)), changes
