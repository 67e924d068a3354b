"""layers/moe.py and the expert families' weight loading: the grouped-by-expert products equal a naive
per-token loop (and transformers' experts bit for bit in bfloat16), routing normalises as each family
does, tensor-parallel shards sum to the whole layer, and both checkpoint layouts of expert weights load
(a missing expert is refused)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from paged_runtime.layers.decode_plan import Undescribable
from paged_runtime.layers.linear import TensorParallel
from paged_runtime.layers.moe import FusedMoE, select_experts
from paged_runtime.layers.ops import TorchOps
from paged_runtime.models.loader import load_model
from paged_runtime.models.qwen3_moe import has_experts

CPU, F32 = torch.device("cpu"), torch.float32
E, K, H, I, T = 8, 3, 32, 24, 37


@dataclass(frozen=True)
class LocalRanks(TensorParallel):
    """A rank whose all-reduce is left to the test: it returns its partial sum as it is."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def randn(*shape: int, seed: int = 0, dtype=F32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def experts(dtype=F32, tp: TensorParallel = TensorParallel(), renormalize=True, seed=0,
            fp32_routing_weights=False) -> tuple[FusedMoE, list]:
    """A FusedMoE loaded from per-expert (gate, up, down) matrices, and those matrices."""
    layer = FusedMoE(E, K, H, I, renormalize, TorchOps(), dtype, CPU, tp, fp32_routing_weights)
    def matrix(rows, cols, seed):  # scaled so that every product stays ~1: float32 noise stays ~1e-7
        return (randn(rows, cols, seed=seed) / cols ** 0.5).to(dtype)
    mats = [(matrix(I, H, seed + 3 * e), matrix(I, H, seed + 3 * e + 1), matrix(H, I, seed + 3 * e + 2))
            for e in range(E)]
    for e, (gate, up, down) in enumerate(mats):
        layer.weight_loader(layer.w13_weight, gate, "w1", e)
        layer.weight_loader(layer.w13_weight, up, "w3", e)
        layer.weight_loader(layer.w2_weight, down, "w2", e)
    return layer, mats


def naive_moe(x, logits, mats, renormalize):
    """One token at a time, one expert at a time: the definition."""
    probs = torch.softmax(logits.float(), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        weights, ids = probs[t].topk(K)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in sorted(zip(weights.tolist(), ids.tolist()), key=lambda pair: pair[1]):
            gate, up, down = mats[e]
            out[t] += w * (down @ (F.silu(gate @ x[t]) * (up @ x[t])))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_per_token_loop(renormalize):
    layer, mats = experts(renormalize=renormalize)
    x, logits = randn(T, H, seed=100), randn(T, E, seed=101) * 2
    ids = select_experts(logits, K, renormalize, F32)[1]
    assert set(ids.flatten().tolist()) == set(range(E))  # every expert has rows to multiply
    torch.testing.assert_close(layer(x, logits), naive_moe(x, logits, mats, renormalize), rtol=1e-5, atol=1e-6)


def test_routing_normalises_as_each_family_does():
    logits = randn(5, E, seed=7, dtype=torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = probs.topk(K)
    kept, kept_ids = select_experts(logits, K, False, torch.bfloat16)  # Qwen3-MoE / OLMoE by default
    assert torch.equal(kept_ids, ids) and kept.dtype == torch.bfloat16 and torch.equal(kept, top.bfloat16())
    renormed, _ = select_experts(logits, K, True, F32)  # Mixtral: renormalised, kept in float32
    assert renormed.dtype == F32 and torch.equal(renormed, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(renormed.sum(-1), torch.ones(5))


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_bfloat16_experts_equal_transformers_bit_for_bit(family):
    """transformers' experts loop (index_add per expert, ascending) and its routers' dtype casts."""
    import transformers as tf
    if family == "mixtral":
        config = tf.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        block = tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    else:
        config = tf.OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                norm_topk_prob=False)
        block = tf.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock(config)
    config._experts_implementation = "eager"
    layer, mats = experts(torch.bfloat16, renormalize=family == "mixtral", fp32_routing_weights=family == "mixtral")
    gate = randn(E, H, seed=55, dtype=torch.bfloat16)
    with torch.no_grad():
        block.gate.weight.copy_(gate)
        block.experts.gate_up_proj.copy_(torch.stack([torch.cat([g, u]) for g, u, _ in mats]))
        block.experts.down_proj.copy_(torch.stack([d for _, _, d in mats]))
        block.to(torch.bfloat16)
        x = randn(1, T, H, seed=9, dtype=torch.bfloat16)
        want = block(x)[0]
    assert torch.equal(layer(x[0], F.linear(x[0], gate)), want)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_the_cpu_kernel_op_set_computes_the_same_experts(dtype):
    """CpuKernelOps multiplies small expert groups with its own linear kernel and SwiGLU; same rounding points."""
    from paged_runtime.config import default_cache_dir
    from paged_runtime.kernels import cpu
    from paged_runtime.layers.ops import CpuKernelOps
    if not cpu.load(default_cache_dir()):
        pytest.skip("no C compiler: the CPU kernels are off")
    layer, _ = experts(dtype)
    x, logits = randn(T, H, seed=100, dtype=dtype), randn(T, E, seed=101, dtype=dtype)
    want = layer(x, logits)
    layer.ops = CpuKernelOps(pack_budget=0)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == F32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer(x, logits), want, **tolerance)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_the_cuda_grouped_mm_path_computes_the_same_experts(dtype, monkeypatch):
    """CUDA's branch (one grouped_mm over device-side group ends), run on the CPU's grouped_mm kernel."""
    from paged_runtime.layers import ops
    if not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    layer, _ = experts(dtype)
    x, logits = randn(T, H, seed=100, dtype=dtype), randn(T, E, seed=101, dtype=dtype)
    want = layer(x, logits)
    monkeypatch.setattr(ops, "_grouped_mm_runs_on", lambda device: True)
    assert torch.equal(layer(x, logits), want)


def test_tensor_parallel_shards_sum_to_the_whole_layer():
    whole, _ = experts()
    x, logits = randn(T, H, seed=100), randn(T, E, seed=101)
    shards = [experts(tp=LocalRanks(rank, 2))[0] for rank in range(2)]
    assert shards[1].w13_weight.shape == (E, I, H) and shards[1].w2_weight.shape == (E, H, I // 2)
    assert torch.equal(shards[1].w13_weight[2, : I // 2], whole.w13_weight[2, I // 2: I])  # gate rows, 2nd half
    torch.testing.assert_close(sum(s(x, logits) for s in shards), whole(x, logits), rtol=1e-5, atol=1e-5)


def test_a_wrong_expert_tensor_is_refused():
    layer = FusedMoE(E, K, H, I, True, TorchOps(), F32, CPU)
    with pytest.raises(ValueError, match="expert 8 is out of range"):
        layer.weight_loader(layer.w13_weight, randn(I, H), "w1", 8)
    with pytest.raises(ValueError, match=r"shape \(32, 32\), expected 24 along dimension 0"):
        layer.weight_loader(layer.w13_weight, randn(H, H), "w3", 0)
    with pytest.raises(ValueError, match="unknown expert shard 'w4'"):
        layer.weight_loader(layer.w2_weight, randn(H, I), "w4", 0)


def test_qwen3_moe_puts_experts_on_every_step_th_layer_but_the_mlp_only_ones():
    raw = {"num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [has_experts(raw, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not has_experts({"num_experts": 0}, 0)


@pytest.fixture(scope="module")
def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=128, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def test_per_expert_and_stacked_checkpoints_load_the_same_weights(tiny_mixtral, tmp_path):
    tiny_mixtral.save_pretrained(tmp_path / "per-expert")  # block_sparse_moe.experts.{e}.w1/w3/w2
    tiny_mixtral.save_pretrained(tmp_path / "stacked", save_original_format=False)  # mlp.experts.gate_up_proj
    assert any(".block_sparse_moe.experts.3.w3." in n for n in load_file(tmp_path / "per-expert/model.safetensors"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "stacked/model.safetensors")
    models = [load_model(tmp_path / name, 64, F32, CPU) for name in ("per-expert", "stacked")]
    hf_experts = tiny_mixtral.model.layers[1].mlp.experts
    for model in models:
        ours = model.layers[1].mlp.experts
        assert torch.equal(ours.w13_weight, hf_experts.gate_up_proj) and torch.equal(ours.w2_weight,
                                                                                    hf_experts.down_proj)


def test_a_checkpoint_missing_an_expert_is_refused(tiny_mixtral, tmp_path):
    tiny_mixtral.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    missing = r"lacks weights for 1 parameters, e.g. \['layers.0.mlp.experts.w13_weight#2.w3"
    with pytest.raises(ValueError, match=missing):
        load_model(tmp_path, 64, F32, CPU)


# config.json of published checkpoints (transformers 4.x keys), cut to 2 layers; built on the meta device.
PUBLISHED = {
    "Mixtral-8x7B": {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "rope_theta": 1e6, "sliding_window": None, "vocab_size": 32000},
    "OLMoE-1B-7B": {"architectures": ["OlmoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 1024,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
                    "norm_topk_prob": False, "clip_qkv": None, "vocab_size": 50304},
    "Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "head_dim": 128, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                      "sliding_window": None, "vocab_size": 151936},
}


@pytest.mark.parametrize("name, experts, w13, top_k, renormalize, fp32_weights", [
    ("Mixtral-8x7B", 8, (8, 2 * 14336, 4096), 2, True, True),
    ("OLMoE-1B-7B", 64, (64, 2 * 1024, 2048), 8, False, False),
    ("Qwen3-30B-A3B", 128, (128, 2 * 768, 2048), 8, True, False),
])
def test_published_moe_configs_build_their_experts(name, experts, w13, top_k, renormalize, fp32_weights):
    from paged_runtime.models.config import ModelConfig
    from paged_runtime.models import registry
    c = ModelConfig.from_dict({**PUBLISHED[name], "num_hidden_layers": 2, "max_position_embeddings": 4096})
    model = registry.family(c.architecture).model_class(c, 4096, torch.bfloat16, torch.device("meta"))
    moe = model.layers[1].mlp.experts
    assert (moe.num_experts, tuple(moe.w13_weight.shape), moe.top_k) == (experts, w13, top_k)
    assert (moe.renormalize, moe.fp32_routing_weights) == (renormalize, fp32_weights)
    with pytest.raises(Undescribable):  # experts (and OLMoE's q/k norms) run op by op
        model.describe_decoder_layers()
    assert c.sliding_window is None
