"""The compiled CPU LoRA delta (``cpu_lora_delta``, and the compiled decode step's) against ``TorchOps.lora_delta``.

Rows mix the base model (-1) with several slots; parts have unequal widths that are not multiples of 16 (the
kernel's column blocks), ranks are zero-padded below the slots' rank and one rank spans more than one of the
kernel's transposed tiles of B. float32 agrees to float32 summation order; bfloat16 rounds where the reference
rounds (the shrink, the expand, the add), so it stays within a rounding step of it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.layers.ops import CpuKernelOps, TorchOps

pytestmark = pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")

DTYPES = (torch.float32, torch.bfloat16)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """As ``tests/unit/test_cpu_kernels.py``: float32 rounding, or in bfloat16 two steps of each value plus one
    step at the tensor's largest magnitude."""
    if dtype == torch.float32:
        return torch.allclose(out.float(), ref.float(), rtol=1e-5, atol=1e-5)
    return torch.allclose(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -7 * ref.float().abs().max().item())


def random_slots(num_slots: int, slices, rank: int, k: int, dtype: torch.dtype, g: torch.Generator,
                 used=(None, 5, 8), std: float = 0.3):
    """Slot tensors as ``layers/lora.py`` holds them (a [S, N*R, k], b [S, out, R]), slot s using ``used[s]``
    of the R ranks of each part (None: all; the rest zero, as a smaller adapter's padding)."""
    a = torch.randn(num_slots, len(slices) * rank, k, generator=g) * std
    b = torch.randn(num_slots, sum(slices), rank, generator=g) * std
    for s, r in enumerate(used[:num_slots]):
        if r is not None:
            for part in range(len(slices)):
                a[s, part * rank + r:(part + 1) * rank] = 0
            b[s, :, r:] = 0
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("slices", [(96,), (64, 29), (96, 32, 17)], ids=["one", "two", "three"])
@pytest.mark.parametrize("rank", [8, 16, 70])
def test_lora_delta_matches_torch_ops(dtype, rows, slices, rank):
    g = torch.Generator().manual_seed(rows * 31 + rank + len(slices))
    k = 77  # not a multiple of 16: the shrink's tail
    a, b = random_slots(3, slices, rank, k, dtype, g)
    x = torch.randn(rows, k, generator=g).to(dtype)
    y = torch.randn(rows, sum(slices), generator=g).to(dtype)
    row_slots = torch.tensor(([0, -1, 2, 0, 1, -1, 2, 2, 1, 1, 0] * 4)[:rows])  # 33: 3 slots, 9 rows each
    ref = y.clone()
    TorchOps.lora_delta(ref, x, a, b, row_slots, slices)
    out = y.clone()
    cpu.cpu_lora_delta(out, x, a, b, row_slots, list(slices))
    base = row_slots == -1
    assert torch.equal(out[base], y[base])  # base rows untouched, bit for bit
    assert close(out, ref, dtype)
    assert not close(y[~base], ref[~base], dtype)  # the delta is not lost in the tolerance


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_of_one_slot_run_in_groups(dtype):
    """A slot's rows beyond the kernel's group size (16) run as several groups: a prefill chunk's rows."""
    g = torch.Generator().manual_seed(9)
    slices = (96, 32, 17)
    a, b = random_slots(3, slices, 16, 77, dtype, g)
    x = torch.randn(70, 77, generator=g).to(dtype)
    y = torch.randn(70, sum(slices), generator=g).to(dtype)
    row_slots = torch.tensor([1] * 37 + [-1] * 3 + [2] * 30)
    ref, out = y.clone(), y.clone()
    TorchOps.lora_delta(ref, x, a, b, row_slots, slices)
    cpu.cpu_lora_delta(out, x, a, b, row_slots, list(slices))
    assert close(out, ref, dtype) and torch.equal(out[37:40], y[37:40])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_op_set_takes_the_kernel_and_falls_back_for_a_strided_output(dtype, monkeypatch):
    """A long prefill chunk takes TorchOps' GEMMs too (``LORA_KERNEL_MAX_ROWS``)."""
    from paged_runtime.layers.ops import LORA_KERNEL_MAX_ROWS
    g = torch.Generator().manual_seed(5)
    slices = (40, 24)
    a, b = random_slots(2, slices, 16, 64, dtype, g)
    x = torch.randn(5, 64, generator=g).to(dtype)
    row_slots = torch.tensor([1, -1, 0, 1, 0])
    wide = torch.randn(5, 2 * sum(slices), generator=g).to(dtype)
    ref = wide.clone()
    TorchOps.lora_delta(ref[:, ::2], x, a, b, row_slots, slices)
    calls = []
    monkeypatch.setattr(cpu, "cpu_lora_delta", lambda *args: calls.append(args) or None)
    CpuKernelOps.lora_delta(wide[:, ::2], x, a, b, row_slots, slices)  # y is written in place: not a copy
    assert not calls and torch.equal(wide, ref)
    CpuKernelOps.lora_delta(wide[:, :sum(slices)].contiguous(), x, a, b, row_slots, slices)
    assert len(calls) == 1
    rows = LORA_KERNEL_MAX_ROWS + 1
    long_y, long_x = torch.zeros(rows, sum(slices), dtype=dtype), torch.randn(rows, 64, generator=g).to(dtype)
    CpuKernelOps.lora_delta(long_y, long_x, a, b, torch.ones(rows, dtype=torch.int64), slices)
    assert len(calls) == 1 and long_y.abs().sum() > 0


def test_a_slot_out_of_range_is_refused():
    a, b = random_slots(2, (32,), 8, 16, torch.float32, torch.Generator().manual_seed(0))
    x, y = torch.randn(3, 16), torch.randn(3, 32)
    for bad in (2, -2):
        with pytest.raises(ValueError, match="outside"):
            cpu.cpu_lora_delta(y, x, a, b, torch.tensor([0, bad, -1]), [32])
    with pytest.raises(ValueError, match="summing to 32"):
        cpu.cpu_lora_delta(y, x, a, b, torch.tensor([0, 1, -1]), [16, 8])


def test_the_op_has_a_fake_implementation_and_a_profiler_name():
    from torch._subclasses.fake_tensor import FakeTensorMode
    a, b = random_slots(2, (32,), 8, 16, torch.float32, torch.Generator().manual_seed(0))
    x, y, row_slots = torch.randn(3, 16), torch.randn(3, 32), torch.tensor([0, 1, -1])
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (y, x, a, b, row_slots)]
        assert torch.ops.paged_runtime.cpu_lora_delta(*args, [32]) is None
    with torch.profiler.profile() as prof:
        cpu.cpu_lora_delta(y, x, a, b, row_slots, [32])
    assert "paged_runtime::cpu_lora_delta" in {event.key for event in prof.key_averages()}


# ---- the compiled decode step -------------------------------------------------------------------------------
_SHAPE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 96, "intermediate_size": 160,
          "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
          "rms_norm_eps": 1e-6}


def _lora_layer_case(dtype, rows):
    """A Llama decoder layer (hidden 96, 6 query / 2 KV heads of 16, intermediate 160) with random weights and
    three adapter slots of rank 16 (two of them padded from smaller ranks), ``rows`` decode rows over ragged
    contexts mixing base rows with every slot. Returns (its description, the step's arguments with the rows'
    slots, the TorchOps forward's x, residual and cache after the step, the step's inputs)."""
    from paged_runtime.attention.torch_backend import AttentionMetadata, decode_group
    from paged_runtime.layers.linear import SINGLE, UnquantizedLinearMethod
    from paged_runtime.layers.lora import enable_lora
    from paged_runtime.layers.rotary import RotaryEmbedding
    from paged_runtime.models.config import ModelConfig
    from paged_runtime.models.llama import LlamaDecoderLayer
    config, cpu_device, ops = ModelConfig.from_dict(_SHAPE), torch.device("cpu"), TorchOps()
    rope = RotaryEmbedding(16, 512, config.rope_theta, config.rope_scaling, ops, cpu_device)
    layer = LlamaDecoderLayer(config, rope, ops, UnquantizedLinearMethod(ops), dtype, cpu_device, SINGLE, 0)
    holder = nn.Module()
    holder.layers = nn.ModuleList([layer])  # enable_lora gives the linears of a model's decoder layers slots
    step = enable_lora(holder, 3, 16, ops, dtype, cpu_device)
    g = torch.Generator().manual_seed(rows)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        # deltas of about the products' size: the output stays at the magnitude float32's tolerance is set for
        a, b = random_slots(3, linear.lora.slices, 16, linear.input_size, dtype, g, std=0.1)
        linear.lora.a.copy_(a)
        linear.lora.b.copy_(b)
    block_size, lens = 16, torch.tensor([1, 40, 200, 17, 16, 33, 90, 5, 64, 2, 150][:rows])
    tables = torch.randperm(192, generator=g).view(12, 16)[:rows]  # each row owns its blocks
    positions = lens - 1
    slots = tables[torch.arange(rows), positions // block_size] * block_size + positions % block_size
    kv_cache = torch.randn(192 * block_size, 2, 2, 16, generator=g).to(dtype)
    x, residual = (torch.randn(rows, 96, generator=g).to(dtype) for _ in range(2))
    t = torch.arange(int(lens.max()))
    gather = tables[:, t // block_size] * block_size + t % block_size
    meta = AttentionMetadata(slots, [decode_group(0, gather, lens)], [])
    step.row_slots = torch.tensor([2, -1, 0, 1, 0, 2, -1, 1, 1, 0, 2][:rows])
    layer.self_attn.attn.kv_cache = ref_cache = kv_cache.clone()
    with torch.inference_mode():
        ref_x, ref_residual = layer(x, residual.clone(), rope.inputs(positions, dtype), meta)
    layer.self_attn.attn.kv_cache = kv_cache  # the step's own: described with the layer
    return (layer.describe(), (positions, slots, tables, lens, block_size, step.row_slots),
            (ref_x, ref_residual, ref_cache), (x, residual, kv_cache))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 11])
def test_the_compiled_decode_step_adds_each_rows_delta(dtype, rows):
    """One layer with adapter slots run in C, its rows' slots given = its forward on TorchOps, which adds each
    product's delta op by op: output, residual and stored K/V."""
    description, step, (ref_x, ref_residual, ref_cache), (x, residual, kv_cache) = _lora_layer_case(dtype, rows)
    assert all(getattr(description, m).lora is not None for m in ("qkv", "o", "gate_up", "down"))
    stack = cpu.DecodeStack([description], dtype)
    base_x, base_residual = x.clone(), residual.clone()
    cpu.DecodeStack([description], dtype).run(base_x, base_residual, *step[:-1], None)  # no row runs an adapter
    stack.run(x, residual, *step)
    assert close(kv_cache, ref_cache, dtype)
    assert close(residual, ref_residual, dtype)
    if dtype == torch.float32:
        assert close(x, ref_x, dtype)
    else:  # a whole layer of bfloat16 roundings, taken in a different summation order: a few steps apart
        assert (x.float() - ref_x.float()).abs().max() <= 2 ** -5 * ref_x.float().abs().max()
    assert (base_x - x).abs().max() > 0.1 * ref_x.float().abs().max()  # the deltas changed the output


def test_a_decode_stack_without_slots_refuses_rows_that_run_adapters():
    import dataclasses
    description, step, _, (x, residual, _) = _lora_layer_case(torch.float32, 3)
    plain = dataclasses.replace(description, **{m: dataclasses.replace(getattr(description, m), lora=None)
                                                for m in ("qkv", "o", "gate_up", "down")})
    with pytest.raises(ValueError, match="no adapter slots"):
        cpu.DecodeStack([plain], torch.float32).run(x, residual, *step)
    with pytest.raises(RuntimeError, match="pr_decode_layers failed"):  # a slot past the three
        cpu.DecodeStack([description], torch.float32).run(x, residual, *step[:-1], torch.tensor([0, 3, -1]))
