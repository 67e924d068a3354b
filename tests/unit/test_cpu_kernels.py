"""The compiled CPU kernels against the PyTorch path they replace (float32 and bfloat16).

float32 results agree to float32 summation order; bfloat16 results round at the
same points as PyTorch, so element-wise kernels match it bit for bit and sums
differ by at most a rounding step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.layers.ops import TorchOps

pytestmark = pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")

DTYPES = (torch.float32, torch.bfloat16)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within float32 rounding; in bfloat16, two steps of each value plus one step at the tensor's largest
    magnitude (a sum like the residual's rounds at the scale of its terms, not of its result)."""
    if dtype == torch.float32:
        return torch.allclose(out.float(), ref.float(), rtol=1e-5, atol=1e-5)
    return torch.allclose(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -7 * ref.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 16])
def test_linear_matches_the_float32_product(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 77, generator=g).to(dtype)  # K not a multiple of 16: the masked tail
    w = torch.randn(301, 77, generator=g).to(dtype)  # N odd: uneven thread shares
    out = cpu.cpu_linear(x, w, None)
    assert out.shape == (rows, 301) and out.dtype == dtype
    assert close(out, F.linear(x.float(), w.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    g = torch.Generator().manual_seed(1)
    x, residual, weight = (torch.randn(*s, generator=g).to(dtype) for s in ((3, 96), (3, 96), (96,)))
    out = cpu.cpu_rms_norm(x, None, weight, 1e-6)
    assert close(out, TorchOps.rms_norm(x, weight, 1e-6)[0], dtype)
    ref_out, ref_residual = TorchOps.rms_norm(x, weight, 1e-6, residual)
    updated = residual.clone()
    out = cpu.cpu_rms_norm(x, updated, weight, 1e-6)
    assert torch.equal(updated, ref_residual)  # the add is one rounding, as in PyTorch
    assert close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_in_place_exactly_as_pytorch(dtype):
    heads, kv_heads, dim, rows = 4, 2, 32, 5
    sizes = (heads * dim, kv_heads * dim, kv_heads * dim)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, sum(sizes), generator=g).to(dtype)
    positions = torch.tensor([0, 1, 17, 300, 999])
    freqs = torch.outer(torch.arange(1024, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    ref = TorchOps.rope(qkv.clone(), sizes, dim, TorchOps.rope_inputs(cos, sin, positions, dtype))
    rotated = qkv.clone()
    cpu.cpu_rope_(rotated, heads + kv_heads, dim, positions, cos, sin)
    q, k, v = (t.view(rows, -1, dim) for t in rotated.split(sizes, dim=-1))
    assert torch.equal(q, ref[0]) and torch.equal(k, ref[1]) and torch.equal(v, ref[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = (torch.randn(3, 2 * 200, generator=torch.Generator().manual_seed(3)) * 6).to(dtype)
    out = cpu.cpu_silu_mul(gate_up)
    ref = TorchOps.silu_mul(gate_up)
    assert close(out, ref, dtype)
    if dtype == torch.bfloat16:
        # The vector exp is within ~1 float32 ulp of PyTorch's: that flips a bfloat16 rounding only for values
        # within an ulp of a halfway point (~2^-15 of them); 2% of values flipped would be a different exp.
        assert (out != ref).float().mean() < 0.02


def gathered_attention(q, kv_cache, tables, lens, block_size, scale):
    """Reference: gather each row's context and run SDPA in float32."""
    rows = []
    for b, length in enumerate(lens.tolist()):
        t = torch.arange(length)
        context = kv_cache[tables[b, t // block_size] * block_size + t % block_size].float()
        out = F.scaled_dot_product_attention(q[b].float()[:, None], context[:, 0].transpose(0, 1),
                                             context[:, 1].transpose(0, 1), scale=scale, enable_gqa=True)
        rows.append(out[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 48), (6, 2, 40)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("copies", [1, 16])
def test_paged_decode_attention(dtype, heads, kv_heads, dim, block_size, copies):
    """GQA ratios 1/3/4/8; head dims on the vector path (64, 128, 48) and off it (40); ragged lengths
    that start, end and cross blocks and runs of 16 tokens, over shuffled block tables. 5 rows take (row, KV
    head) items; 80 take whole rows (4 a thread, up to 20 threads)."""
    g = torch.Generator().manual_seed(heads * dim + block_size)
    num_blocks, lens = 48, torch.tensor([1, block_size, block_size + 1, 37, 300] * copies)
    kv_cache = torch.randn(num_blocks * block_size, 2, kv_heads, dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:20] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    out = cpu.cpu_paged_decode_attention(q, kv_cache, tables, lens, block_size, dim ** -0.5)
    ref = gathered_attention(q, kv_cache, tables, lens, block_size, dim ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - ref).abs().max() <= tolerance


def test_attention_reads_strided_query_rows():
    """q as the model passes it: a view into fused qkv rows."""
    heads, kv_heads, dim, block_size = 4, 2, 64, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    q = qkv[:, :heads * dim].view(3, heads, dim)
    kv_cache = torch.randn(64, 2, kv_heads, dim)
    tables, lens = torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.tensor([5, 20, 32])
    out = cpu.cpu_paged_decode_attention(q, kv_cache, tables, lens, block_size, 0.125)
    assert torch.allclose(out, gathered_attention(q, kv_cache, tables, lens, block_size, 0.125), atol=1e-5)


def causal_reference(q, kv_cache, table, context_len, block_size, scale, window=0):
    """Reference for a prompt chunk: q's rows are the last queries of the context; float32 SDPA, masked."""
    t = torch.arange(context_len)
    context = kv_cache[table[t // block_size] * block_size + t % block_size].float()
    positions = torch.arange(context_len - q.shape[0], context_len)
    mask = t[None] <= positions[:, None]
    if window:
        mask &= t[None] > positions[:, None] - window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), context[:, 0].transpose(0, 1),
                                         context[:, 1].transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (8, 1, 48), (6, 2, 40)])
@pytest.mark.parametrize("queries,context,window", [(45, 45, 0), (100, 300, 0), (257, 257, 0), (70, 200, 50)])
def test_paged_prompt_attention(dtype, heads, kv_heads, dim, queries, context, window):
    """A prompt chunk (a whole prompt, or the last queries of a longer context) in flash blocks: GQA ratios
    1/3/4/8 (items of 48, 16, 12 and 6 rows; query vectors padded to whole groups of 6), contexts that end
    inside a block of 16 and of 64 keys, a window that starts past the first key, over a shuffled table;
    head dim 40 goes to the row kernel instead."""
    block_size = 16
    g = torch.Generator().manual_seed(heads * dim + queries)
    num_blocks = -(-context // block_size) + 3
    kv_cache = torch.randn(num_blocks * block_size, 2, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)
    q = torch.randn(queries, heads, dim, generator=g).to(dtype)
    out = cpu.cpu_paged_prompt_attention(q, kv_cache, table, context, block_size, dim ** -0.5, window)
    ref = causal_reference(q, kv_cache, table, context, block_size, dim ** -0.5, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and (out.float() - ref).abs().max() <= tolerance


def test_prompt_attention_reads_strided_query_rows_and_refuses_a_table_it_cannot_read():
    heads, kv_heads, dim, block_size = 4, 2, 64, 16
    qkv = torch.randn(40, (heads + 2 * kv_heads) * dim)
    q = qkv[:, :heads * dim].view(40, heads, dim)
    kv_cache = torch.randn(64, 2, kv_heads, dim)
    table = torch.tensor([3, 0, 2, 1])
    out = cpu.cpu_paged_prompt_attention(q, kv_cache, table, 50, block_size, 0.125)
    assert torch.allclose(out, causal_reference(q, kv_cache, table, 50, block_size, 0.125), atol=1e-5)
    # too short; int32; two-dimensional; strided (each but the first long enough for 50 tokens)
    for bad_table, context in ((table, 65), (table.int(), 50), (table.repeat(4)[None], 50),
                               (table.repeat(2)[::2], 50)):
        with pytest.raises(ValueError, match=f"needs a contiguous int64 table of {-(-context // 16)} blocks"):
            cpu.cpu_paged_prompt_attention(q, kv_cache, bad_table, context, block_size, 0.125)
    with pytest.raises(ValueError, match="query heads a multiple of kv_heads"):
        cpu.cpu_paged_prompt_attention(q[:, :3], kv_cache, table, 50, block_size, 0.125)
    assert cpu.cpu_paged_prompt_attention(q[:0], kv_cache, table, 50, block_size, 0.125).shape == (0, heads, dim)


# Each family's layer the compiled decode step describes differently: Llama (qkv bias), Qwen3 (q/k norms),
# Gemma 3 (four (1 + w) norms, q/k norms, GeGLU, its query scale), Phi-3 (partial rotary: 12 of 16 dims).
_SHAPE = {"vocab_size": 100, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 1,
          "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6}
_FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "attention_bias": True},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"]},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "query_pre_attn_scalar": 24, "sliding_window": 64,
               "layer_types": ["full_attention"]},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75},
}


def _decode_layer_case(dtype, rows, method=None, parts=None, family="llama"):
    """A decoder layer of ``family`` (hidden 96, 6 query / 2 KV heads of 16, intermediate 160) with random
    weights (``parts(name, rows, k) -> (blocks, type id)``: GGUF blocks of each part for ``method``), ``rows``
    decode rows over ragged contexts; returns (layer, the step's index arguments, the PyTorch path's x,
    residual and cache after the step, the step's inputs)."""
    from paged_runtime.attention.torch_backend import AttentionMetadata, decode_group
    from paged_runtime.layers.linear import SINGLE, UnquantizedLinearMethod
    from paged_runtime.layers.rotary import RotaryEmbedding
    from paged_runtime.models.config import ModelConfig
    from paged_runtime.models.gemma3 import Gemma3DecoderLayer
    from paged_runtime.models.llama import LlamaDecoderLayer
    from paged_runtime.models.qwen3 import Qwen3DecoderLayer
    layer_class = {"qwen3": Qwen3DecoderLayer, "gemma3": Gemma3DecoderLayer}.get(family, LlamaDecoderLayer)
    config = ModelConfig.from_dict(_SHAPE | _FAMILIES[family])
    cpu_device, ops = torch.device("cpu"), TorchOps()
    rope = RotaryEmbedding(16, 512, config.rope_theta, config.rope_scaling, ops, cpu_device)
    layer = layer_class(config, rope, ops, method or UnquantizedLinearMethod(ops), dtype, cpu_device, SINGLE, 0)
    g = torch.Generator().manual_seed(rows)
    for p in layer.parameters():
        if p.dtype == dtype:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if parts is not None:
        a, m = layer.self_attn, layer.mlp
        for linear, shards in ((a.qkv_proj, {"q": 96, "k": 32, "v": 32}), (a.o_proj, {"o": 96}),
                               (m.gate_up_proj, {0: 160, 1: 160}), (m.down_proj, {"down": 96})):
            for name, rows_ in shards.items():
                raw, qtype = parts(name, rows_, linear.input_size)
                shard = name if name not in ("o", "down") else None
                linear.qweight.weight_loader(linear.qweight, raw, shard)
                linear.qweight_type.weight_loader(linear.qweight_type, torch.full((len(raw),), qtype), shard)
            linear.process_weights_after_loading()
    block_size, lens = 16, torch.tensor(([1, 40, 200, 17, 16, 33, 90, 5, 64, 2, 150] * 5)[:rows])
    blocks = 16 * max(12, rows)
    tables = torch.randperm(blocks, generator=g).view(-1, 16)[:rows]  # each row owns its blocks
    positions = lens - 1
    slots = tables[torch.arange(rows), positions // block_size] * block_size + positions % block_size
    kv_cache = torch.randn(blocks * block_size, 2, 2, 16, generator=g).to(dtype)
    x, residual = (torch.randn(rows, 96, generator=g).to(dtype) for _ in range(2))
    t = torch.arange(int(lens.max()))
    gather = tables[:, t // block_size] * block_size + t % block_size  # the PyTorch path's gathered context
    meta = AttentionMetadata(slots, [decode_group(0, gather, lens)], [])
    layer.self_attn.attn.kv_cache = ref_cache = kv_cache.clone()
    ref_x, ref_residual = layer(x, residual.clone(), rope.inputs(positions, dtype), meta)
    layer.self_attn.attn.kv_cache = kv_cache  # the step's own: described with the layer
    return layer, (positions, slots, tables, lens, block_size), (ref_x, ref_residual, ref_cache), (x, residual,
                                                                                                  kv_cache)


def _run_stack(descriptions, dtype, x, residual, step) -> None:
    cpu.DecodeStack(descriptions, dtype).run(x, residual, *step)


def _assert_step_matches(dtype, refs, outs) -> None:
    (ref_x, ref_residual, ref_cache), (x, residual, kv_cache) = refs, outs
    assert close(kv_cache, ref_cache, dtype)
    assert close(residual, ref_residual, dtype)
    if dtype == torch.float32:
        assert close(x, ref_x, dtype)
    else:  # a whole layer of bfloat16 roundings, taken in a different summation order: a few steps apart
        assert (x.float() - ref_x.float()).abs().max() <= 2 ** -5 * ref_x.float().abs().max()


@pytest.mark.parametrize("family", sorted(_FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 45])
def test_the_compiled_decode_step_matches_the_layer_on_pytorch_ops(family, dtype, rows):
    """One layer's description run in C = its forward on TorchOps: output, residual and stored K/V. 45 rows:
    products in two passes of rows (MAX_ROWS, then the rest)."""
    layer, step, refs, (x, residual, kv_cache) = _decode_layer_case(dtype, rows, family=family)
    assert cpu.DecodeStack([layer.describe()], dtype).max_rows == cpu.max_rows()  # plain weights: the plan's limit
    _run_stack([layer.describe()], dtype, x, residual, step)
    _assert_step_matches(dtype, refs, (x, residual, kv_cache))


# Five 32-weight types over the layer's matrices; q and k in one type, v in another: qkv is two parts.
_GGUF_LAYER_TYPES = {"q": "Q4_1", "k": "Q4_1", "v": "Q8_0", "o": "Q4_0", 0: "Q5_1", 1: "Q5_1", "down": "Q5_0"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 11, 45])
@pytest.mark.parametrize("repack", [True, False])
def test_the_compiled_decode_step_takes_gguf_blocks(dtype, rows, repack):
    """The step reads GGUF parts (a two-part qkv of mixed types too; repacked x8 parts beside the file's) as
    the GGUF method multiplies them, ``cpu_gguf_linear``: the same layer, its linears on the GGUF kernels and
    the rest on PyTorch ops, gives what the step gives, within the rounding of the PyTorch ops alone."""
    import numpy as np
    from paged_runtime.kernels.gguf_types import gguf_type, row_bytes
    from paged_runtime.layers.quantization.gguf import GGUFLinearMethod
    rng = np.random.default_rng(rows)

    def parts(name, n, k):
        t = gguf_type(_GGUF_LAYER_TYPES[name])
        raw = rng.integers(0, 256, size=(n, row_bytes(t, k)), dtype=np.uint8)
        blocks = raw.reshape(-1, t.block_bytes)
        blocks[:, :2] = np.full((len(blocks), 1), 0.02, np.float16).view(np.uint8)  # d of every 32-type
        if t.name in ("Q4_1", "Q5_1"):
            blocks[:, 2:4] = np.full((len(blocks), 1), -0.15, np.float16).view(np.uint8)  # and its min
        return torch.from_numpy(raw), t.id

    layer, step, refs, (x, residual, kv_cache) = _decode_layer_case(dtype, rows, GGUFLinearMethod(cpu, repack=repack),
                                                                    parts)
    description = layer.describe()
    x8 = 256 if repack else 0  # every type repacks (their rows are whole groups of 8)
    types = [t for m in (description.qkv, description.o, description.gate_up, description.down) for _, t in m.parts]
    assert len(description.qkv.parts) == 2 and set(types) == {6 | x8, 7 | x8, 2 | x8, 3 | x8, 8 | x8}
    assert cpu.DecodeStack([description], dtype).max_rows is None  # every matrix blocks: any number of rows
    _run_stack([description], dtype, x, residual, step)
    _assert_step_matches(dtype, refs, (x, residual, kv_cache))


def test_the_compiled_decode_step_refuses_a_description_its_weights_do_not_match():
    import dataclasses
    from paged_runtime.layers.decode_plan import MatrixDescription
    layer, step, _, (x, residual, kv_cache) = _decode_layer_case(torch.float32, 1)
    d = layer.describe()
    four = MatrixDescription(d.qkv.parts * 4, d.qkv.bias)
    with pytest.raises(ValueError, match="1..3 parts"):
        cpu.DecodeStack([dataclasses.replace(d, qkv=four)], torch.float32)
    o_as_blocks = MatrixDescription(((d.o.parts[0][0], 2),))  # a plain matrix called Q4_0 blocks
    with pytest.raises(ValueError, match="uint8"):
        cpu.DecodeStack([dataclasses.replace(d, o=o_as_blocks)], torch.float32)
    with pytest.raises(ValueError, match="float32 \\[positions, 8\\]"):  # tables of 16 dims said to rotate 8
        cpu.DecodeStack([dataclasses.replace(d, rot=8)], torch.float32)


@pytest.mark.slow
def test_library_is_cached_by_folder_and_falls_back_without_a_compiler(tmp_path, monkeypatch):
    run_cache = default_cache_dir()  # the run's: built there once (a build of its own cost this test a minute)
    assert cpu.load(run_cache)
    built = cpu.library_path(run_cache)
    stamp = built.stat().st_mtime_ns
    cpu._load.cache_clear()
    assert cpu.load(run_cache) and built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert not cpu.load(tmp_path / "elsewhere")  # a failed build: the PyTorch path
    assert cpu.max_rows() == 32  # the library loaded first stays in use; MAX_ROWS read from the C file


def test_the_kernels_are_a_setting_read_once_from_the_environment(monkeypatch):
    from paged_runtime.config import EngineConfig
    from paged_runtime.layers.ops import CpuKernelOps, select_ops
    cpu_device = torch.device("cpu")
    monkeypatch.setenv("PAGED_RUNTIME_CPU_KERNELS", "0")
    off = EngineConfig()
    monkeypatch.setenv("PAGED_RUNTIME_CPU_KERNELS", "1")
    on = EngineConfig()
    monkeypatch.delenv("PAGED_RUNTIME_CPU_KERNELS")
    assert (off.cpu_kernels, on.cpu_kernels, EngineConfig().cpu_kernels) == (False, True, None)
    assert type(select_ops(cpu_device, torch.float32, off.cpu_kernels, off.cache_dir)) is TorchOps
    assert type(select_ops(cpu_device, torch.float32, True, default_cache_dir())) is CpuKernelOps
    assert type(select_ops(cpu_device, torch.float16, True, default_cache_dir())) is TorchOps
    auto = CpuKernelOps if cpu.has_vector_paths() else TorchOps  # None: the kernels only where they pay
    assert type(select_ops(cpu_device, torch.float32, None, default_cache_dir())) is auto
    monkeypatch.setattr(cpu, "has_vector_paths", lambda isa_name=None: False)
    assert type(select_ops(cpu_device, torch.float32, None, default_cache_dir())) is TorchOps


def test_mid_size_batches_multiply_with_packed_weights(monkeypatch):
    """Between max_rows and PACKED_MAX_ROWS rows, a bfloat16 matrix goes through its oneDNN-packed copy;
    more rows, or a layer without a packed copy, take plain F.linear."""
    from types import SimpleNamespace

    from paged_runtime.layers import ops
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    kernel_ops = ops.CpuKernelOps()
    packed = kernel_ops.pack_weight(w)
    if packed is None:
        pytest.skip("oneDNN cannot pack bfloat16 weights here (torch build or CPU)")
    assert ops.CpuKernelOps(pack_budget=0).pack_weight(w) is None  # over the memory budget: no copy
    plain = []  # (packed and plain results are bitwise equal here: watch which path runs)
    monkeypatch.setattr(ops, "F", SimpleNamespace(linear=lambda *a: plain.append(a[0].shape[0]) or F.linear(*a)))
    for rows in (cpu.max_rows() + 1, 64, ops.PACKED_MAX_ROWS, ops.PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert close(kernel_ops.linear(x, w, bias, packed), F.linear(x.float(), w.float(), bias.float()),
                     torch.bfloat16)
    kernel_ops.linear(torch.randn(63, 64).to(torch.bfloat16), w, bias, None)
    assert plain == [ops.PACKED_MAX_ROWS + 1, 63]


def test_a_nan_in_the_context_reaches_the_output_as_in_pytorch():
    """A NaN key poisons the heads that read it (PyTorch's softmax does the same), not silently dropped."""
    kv_cache = torch.randn(32, 2, 2, 64)
    kv_cache[3, 0, 1, 5] = float("nan")  # token 3's key, KV head 1
    q = torch.randn(1, 4, 64)
    out = cpu.cpu_paged_decode_attention(q, kv_cache, torch.tensor([[0, 1]]), torch.tensor([10]), 16, 0.125)
    ref = gathered_attention(q, kv_cache, torch.tensor([[0, 1]]), torch.tensor([10]), 16, 0.125)
    assert out[0, 2:].isnan().all() and ref[0, 2:].isnan().all()  # heads 2, 3 share KV head 1
    assert torch.allclose(out[0, :2], ref[0, :2], atol=1e-5)


def test_the_kernels_are_torch_ops_with_fake_implementations_and_profiler_names():
    """torch.compile traces the ops through their fake implementations; the profiler names each one."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x, w, gate_up = torch.randn(3, 64), torch.randn(40, 64), torch.randn(3, 80)
    kv_cache, q = torch.randn(64, 2, 2, 16), torch.randn(3, 4, 16)
    tables, lens = torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.tensor([5, 20, 32])
    with FakeTensorMode() as mode:
        f_x, f_w, f_gate_up, f_cache, f_q, f_tables, f_lens = (
            mode.from_tensor(t) for t in (x, w, gate_up, kv_cache, q, tables, lens))
        assert torch.ops.paged_runtime.cpu_linear(f_x, f_w, None).shape == (3, 40)
        assert torch.ops.paged_runtime.cpu_silu_mul(f_gate_up).shape == (3, 40)
        out = torch.ops.paged_runtime.cpu_paged_decode_attention(f_q, f_cache, f_tables, f_lens, 16, 0.25)
        assert out.shape == (3, 4, 16)
    with torch.profiler.profile() as prof:
        cpu.cpu_linear(x, w, None)
        cpu.cpu_paged_decode_attention(q, kv_cache, tables, lens, 16, 0.25)
    names = {event.key for event in prof.key_averages()}
    assert {"paged_runtime::cpu_linear", "paged_runtime::cpu_paged_decode_attention"} <= names
