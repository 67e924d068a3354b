"""The rotary tables and RoPE against transformers' Phi-3 rotary embedding, bit for bit (float32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_runtime.layers.ops import CpuKernelOps, TorchOps
from paged_runtime.layers.rotary import RotaryEmbedding
from paged_runtime.models.config import ModelConfig

SHORT, LONG = [1.0, 1.3, 1.8, 2.5, 3.5, 5.0], [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def phi3(**changes):
    """transformers' config and ours for a head of 16 dims, 12 of them rotating."""
    from transformers import Phi3Config
    kwargs = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  original_max_position_embeddings=64, partial_rotary_factor=0.75, vocab_size=100,
                  rope_scaling={"rope_type": "longrope", "short_factor": list(SHORT), "long_factor": list(LONG)})
    hf = Phi3Config(**(kwargs | changes))
    raw = {"architectures": ["Phi3ForCausalLM"], "intermediate_size": 128, "num_hidden_layers": 1,
           **(kwargs | changes)}
    return hf, ModelConfig.from_dict(raw)


def hf_cos_sin(config, positions: torch.Tensor):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    rotary = Phi3RotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


def ours(c: ModelConfig, max_len: int = 256) -> RotaryEmbedding:
    return RotaryEmbedding(c.head_dim, max_len, c.rope_theta, c.rope_scaling, TorchOps(), torch.device("cpu"))


def test_longrope_tables_are_transformers_short_and_long_rows():
    hf, c = phi3()
    rope = ours(c)
    assert rope.cos.shape == (512, 12) and rope.switch == 64
    short = hf_cos_sin(hf, torch.arange(64))  # a sequence of 64 tokens: short factors
    long = hf_cos_sin(hf, torch.arange(256))  # longer than 64: long factors for every position
    for ours_t, short_t, long_t in zip((rope.cos, rope.sin), short, long):
        assert torch.equal(ours_t[:64], short_t)
        assert torch.equal(ours_t[256:], long_t)
        assert not torch.equal(ours_t[:64], long_t[:64])  # the factors differ, and so do the halves
    assert abs(rope.cos[0, 0].item() - (1 + np.log(4) / np.log(64)) ** 0.5) < 1e-6  # the attention factor


def test_plain_partial_rotary_tables_are_transformers():
    hf, c = phi3(rope_scaling=None)
    rope = ours(c)
    assert rope.cos.shape == (256, 12) and rope.switch is None and not rope.one_table
    cos, sin = hf_cos_sin(hf, torch.arange(256))
    assert torch.equal(rope.cos, cos) and torch.equal(rope.sin, sin)


def test_position_offset_picks_the_long_half_for_requests_longer_than_the_switch():
    _, c = phi3()
    offsets = ours(c).position_offset(np.array([1, 64, 65, 200]))
    assert offsets.tolist() == [0, 0, 256, 256]
    _, plain = phi3(rope_scaling=None, partial_rotary_factor=1.0)
    assert ours(plain).position_offset(np.array([1, 300])).tolist() == [0, 0] and ours(plain).one_table


@pytest.mark.parametrize("ops", [TorchOps(), "cpu-kernels"])
def test_partial_rope_is_transformers_apply_rotary_pos_emb(ops):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    if ops == "cpu-kernels":
        from paged_runtime.config import default_cache_dir
        from paged_runtime.kernels import cpu
        if not cpu.load(default_cache_dir()):
            pytest.skip("no C compiler: the CPU kernels are off")
        ops = CpuKernelOps()
    hf, c = phi3()
    rope = RotaryEmbedding(c.head_dim, 256, c.rope_theta, c.rope_scaling, ops, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g)
    positions = torch.tensor([0, 3, 63, 64, 200]) + 256  # the long half
    q, k, v = rope(qkv.clone(), (64, 32, 32), rope.inputs(positions, torch.float32))
    cos, sin = hf_cos_sin(hf, torch.arange(256))
    heads = lambda t: t.view(5, -1, 16).transpose(0, 1)  # [heads, T, head_dim], as HF's [B=1] squeezed
    ref_q, ref_k = apply_rotary_pos_emb(heads(qkv[:, :64]), heads(qkv[:, 64:96]), cos[positions - 256],
                                        sin[positions - 256], unsqueeze_dim=0)
    assert torch.equal(q.transpose(0, 1), ref_q) and torch.equal(k.transpose(0, 1), ref_k)
    assert torch.equal(v.reshape(5, -1), qkv[:, 96:])
    assert torch.equal(q[..., 12:], qkv[:, :64].view(5, 4, 16)[..., 12:])  # the last 4 dims pass through
