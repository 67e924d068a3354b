"""Pre-quantized checkpoint formats (GPTQ, AWQ, compressed-tensors) and FP8 (layers/quantization).

Each format's tensors are written here by its published layout (compressed-tensors' by the library itself),
unpacked by an independent reader (compressed-tensors' own unpack and AWQ converter; for GPTQ a plain loop
over the spec), and loaded into layers whose products must equal x @ W.T for the reference W = (q - z) * s;
fused and tensor-parallel layers place each packed shard; FP8's ``_scaled_mm`` equals the plain-torch
product of the dequantized operands; what is not supported is refused by name."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from paged_runtime.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                         TensorParallel)
from paged_runtime.layers.quantization import checkpoint_quantization, linear_method
from paged_runtime.layers.quantization.awq import AWQLinearMethod, ORDER, awq_method
from paged_runtime.layers.quantization.compressed_tensors import CompressedInt4Method, compressed_tensors_method
from paged_runtime.layers.quantization.fp8 import (FP8, Fp8CheckpointMethod, Fp8LinearMethod, dequantize_fp8,
                                                   quantize_activations, quantize_fp8)
from paged_runtime.layers.quantization.gptq import GPTQLinearMethod, gptq_method
from paged_runtime.layers.quantization.int4 import dequantize_int4
from paged_runtime.layers.quantization.prequantized import unpack_nibbles
from paged_runtime.layers.ops import TorchOps

CPU, F32, BF16 = torch.device("cpu"), torch.float32, torch.bfloat16
GROUP = 128


@dataclass(frozen=True)
class LocalRank(TensorParallel):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int4_parts(n: int, k: int, seed: int = 0, symmetric: bool = False):
    """Random codes [N, K] in 0..15, zeros [N, K / 128] (8 if symmetric) and float16 scales [N, K / 128]."""
    g = generator(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.full((n, k // GROUP), 8) if symmetric else torch.randint(0, 16, (n, k // GROUP), generator=g)
    scales = (torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001).half()
    return codes, zeros, scales


def reference(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W = (q - z) * s in float32."""
    return (codes - zeros.repeat_interleave(GROUP, 1)).float() * scales.float().repeat_interleave(GROUP, 1)


# ---- the formats' layouts, written from their specs ---------------------------------------------------------

def pack_along(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int32 words of eight 4-bit values along ``dim``; nibble i holds value ``order[i]`` of its eight."""
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    words = sum(v[..., i] << (4 * i) for i in range(8))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)  # the int32 bit pattern
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def gptq_tensors(codes, zeros, scales, v1: bool = True) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight [K/8, N] packed along K, qzeros [G, N/8] along N (v1: z - 1), scales [G, N]."""
    k = codes.shape[1]
    stored = (zeros - 1) & 0xF if v1 else zeros
    return {"qweight": pack_along(codes.t(), 0), "qzeros": pack_along(stored.t(), 1),
            "scales": scales.t().contiguous(), "g_idx": torch.arange(k, dtype=torch.int32) // GROUP}


def awq_tensors(codes, zeros, scales) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight [K, N/8] and qzeros [G, N/8] along N in AWQ's order, scales [G, N]."""
    return {"qweight": pack_along(codes.t(), 1, ORDER), "qzeros": pack_along(zeros.t(), 1, ORDER),
            "scales": scales.t().contiguous()}


def gptq_unpacked_by_loops(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The GPTQ spec read element by element (v1: z = stored + 1): W [N, K] in float32."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(n, k)
    for row in range(k):
        for col in range(n):
            q = (int(qweight[row // 8, col]) >> (4 * (row % 8))) & 0xF
            z = ((int(qzeros[row // GROUP, col // 8]) >> (4 * (col % 8))) & 0xF) + 1
            w[col, row] = (q - z) * float(scales[row // GROUP, col])
    return w


# ---- unpacking against independent readers ------------------------------------------------------------------

def test_gptq_tensors_unpack_as_the_spec_reads_them():
    codes, zeros, scales = int4_parts(16, 256, seed=1)
    zeros = zeros.clamp_min(1)  # v1 cannot store z = 0 (AutoGPTQ's known limitation)
    t = gptq_tensors(codes, zeros, scales)
    assert torch.equal(gptq_unpacked_by_loops(t["qweight"], t["qzeros"], t["scales"]),
                       reference(codes, zeros, scales))
    assert torch.equal(unpack_nibbles(t["qweight"], 0).t(), codes.to(torch.uint8))


def test_awq_tensors_unpack_as_compressed_tensors_converts_them():
    converters = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.autoawq")
    codes, zeros, scales = int4_parts(16, 256, seed=2)
    t = awq_tensors(codes, zeros, scales)
    weight, scale, zero_point = converters.AutoAWQConverter()._convert_gemm_module(t["qweight"], t["scales"],
                                                                                   t["qzeros"])
    assert torch.equal(weight.long() + 8, codes) and torch.equal(zero_point.long() + 8, zeros)
    assert torch.equal(scale, scales)


def test_nibble_unpacking_matches_compressed_tensors_packing():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = torch.randint(-8, 8, (24, 256), generator=generator(3), dtype=torch.int8)
    assert torch.equal(unpack_nibbles(helpers.pack_to_int32(values, 4), 1).to(torch.int8) - 8, values)
    assert torch.equal(unpack_nibbles(helpers.pack_to_int32(values, 4, packed_dim=0), 0).to(torch.int8) - 8,
                       values)
    assert torch.equal(pack_along(values.to(torch.int32) + 8, 1), helpers.pack_to_int32(values, 4))


# ---- layers loaded from checkpoint tensors ------------------------------------------------------------------

def ct_int4_tensors(codes, zeros, scales, symmetric: bool) -> dict[str, torch.Tensor]:
    out = {"weight_packed": pack_along(codes, 1), "weight_scale": scales.float(),
           "weight_shape": torch.tensor(codes.shape)}
    return out if symmetric else {**out, "weight_zero_point": pack_along(zeros, 0)}


FORMATS = {
    "gptq": (lambda: GPTQLinearMethod(cpu_kernels=False), lambda c, z, s, sym: gptq_tensors(c, z.clamp_min(1), s)),
    "gptq-sym": (lambda: GPTQLinearMethod(cpu_kernels=False), lambda c, z, s, sym: gptq_tensors(c, z, s)),
    "gptq_v2": (lambda: GPTQLinearMethod(zero_offset=0, cpu_kernels=False),
                lambda c, z, s, sym: gptq_tensors(c, z, s, v1=False)),
    "awq": (lambda: AWQLinearMethod(cpu_kernels=False), lambda c, z, s, sym: awq_tensors(c, z, s)),
    "ct-w4a16": (lambda: CompressedInt4Method(symmetric=True, cpu_kernels=False), ct_int4_tensors),
    "ct-w4a16-asym": (lambda: CompressedInt4Method(symmetric=False, cpu_kernels=False), ct_int4_tensors),
}


SYMMETRIC = {"gptq-sym", "ct-w4a16"}


def parts_for(fmt: str, n: int, k: int, seed: int):
    codes, zeros, scales = int4_parts(n, k, seed, symmetric=fmt in SYMMETRIC)
    return codes, (zeros.clamp_min(1) if fmt == "gptq" else zeros), scales


def load(layer, tensors: dict[str, torch.Tensor], shard=None) -> None:
    for name, tensor in tensors.items():
        param = getattr(layer, name, None)
        if isinstance(param, torch.nn.Parameter):
            layer.weight_loader(param, tensor, shard)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_fused_qkv_layer_multiplies_by_its_parts_dequantized(fmt):
    method, write = FORMATS[fmt]
    layer = QKVParallelLinear(256, 32, 4, 2, False, method(), F32, CPU)  # q 128 rows, k and v 64 each
    weights = []
    for i, (shard, rows) in enumerate([("q", 128), ("k", 64), ("v", 64)]):
        codes, zeros, scales = parts_for(fmt, rows, 256, seed=10 + i)
        load(layer, write(codes, zeros, scales, fmt in SYMMETRIC), shard)
        weights.append(reference(codes, zeros, scales))
    layer.process_weights_after_loading()
    want = torch.cat(weights)
    assert torch.allclose(dequantize_int4(layer.qweight, layer.scales_and_zeros, 256), want, rtol=0, atol=1e-6)
    x = torch.randn(3, 256, generator=generator(4))
    assert torch.allclose(layer(x), x @ want.T, rtol=1e-5, atol=1e-5)
    assert not list(layer.parameters())  # the checkpoint's tensors are gone; only the int4 buffers stay


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct-w4a16-asym"])
def test_tensor_parallel_ranks_take_their_shard_of_the_packed_tensors(fmt):
    """gate/up split by output rows, down by input groups: two ranks' products are the whole one's."""
    method, write = FORMATS[fmt]
    gate_up = [parts_for(fmt, 128, 256, seed=20 + i) for i in range(2)]
    down = parts_for(fmt, 64, 256, seed=22)
    x = torch.randn(2, 256, generator=generator(5))
    h = torch.randn(2, 256, generator=generator(6))
    total = 0
    for rank in range(2):
        tp = LocalRank(rank, 2)
        merged = MergedColumnParallelLinear(256, [128, 128], False, method(), F32, CPU, tp)
        for i, parts in enumerate(gate_up):
            load(merged, write(*parts, False), i)
        row = RowParallelLinear(256, 64, False, method(), F32, CPU, tp)
        load(row, write(*down, False))
        merged.process_weights_after_loading()
        row.process_weights_after_loading()
        want = torch.cat([reference(*parts)[rank * 64:(rank + 1) * 64] for parts in gate_up])
        assert torch.allclose(merged(x), x @ want.T, rtol=1e-5, atol=1e-5)
        total = total + row(h[:, rank * 128:(rank + 1) * 128])
    assert torch.allclose(total, h @ reference(*down).T, rtol=1e-5, atol=1e-5)


def test_a_rank_without_whole_groups_is_refused():
    with pytest.raises(ValueError, match="whole groups of 128"):
        RowParallelLinear(256, 64, False, GPTQLinearMethod(), F32, CPU, LocalRank(0, 4))


def test_the_cpu_kernel_path_computes_the_same_product():
    """bfloat16 with torch's int4 CPU kernel (its tiling of the same codes) against the dequantize path."""
    codes, zeros, scales = int4_parts(64, 256, seed=7)
    outs = []
    for cpu_kernels in (True, False):
        layer = RowParallelLinear(256, 64, False, GPTQLinearMethod(cpu_kernels=cpu_kernels), BF16, CPU)
        load(layer, gptq_tensors(codes, zeros.clamp_min(1), scales))
        layer.process_weights_after_loading()
        assert layer.int4_kernel == cpu_kernels
        outs.append(layer(torch.randn(3, 256, generator=generator(8)).to(BF16)).float())
    assert torch.allclose(outs[0], outs[1], rtol=0.02, atol=0.02)


@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
def test_a_compressed_tensors_int8_layer_keeps_its_integers(fmt):
    method = compressed_tensors_method(ct_config("int", 8, "channel", fmt))
    layer = RowParallelLinear(128, 48, False, method, F32, CPU)
    q = torch.randint(-128, 128, (48, 128), generator=generator(9), dtype=torch.int8)
    scale = torch.rand(48, 1, generator=generator(10)) * 0.01
    if fmt == "pack-quantized":
        helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
        load(layer, {"weight_packed": helpers.pack_to_int32(q, 8), "weight_scale": scale})
    else:
        load(layer, {"weight": q, "weight_scale": scale})
    layer.process_weights_after_loading()
    assert torch.equal(layer.qweight, q) and torch.equal(layer.scale, scale.view(-1))
    x = torch.randn(2, 128, generator=generator(11))
    assert torch.allclose(layer(x), x @ (q.float() * scale).T, rtol=1e-5, atol=1e-5)


# ---- FP8 ---------------------------------------------------------------------------------------------------

def fp8_reference(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Both operands quantized, dequantized, multiplied in float32."""
    xq, x_scale = quantize_activations(x, input_scale)
    return (xq.float() * x_scale) @ dequantize_fp8(qweight, weight_scale).T


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_scaled_mm_equals_the_dequantized_product(per_channel, dtype):
    weight = torch.randn(96, 160, generator=generator(12)) * 0.05
    layer = RowParallelLinear(160, 96, True, Fp8LinearMethod(per_channel), dtype, CPU)
    layer.weight_loader(layer.weight, weight.to(dtype))
    bias = torch.randn(96, generator=generator(13)).to(dtype)
    layer.weight_loader(layer.bias, bias)
    layer.process_weights_after_loading()
    assert layer.fp8_scaled_mm and layer.qweight.dtype == FP8
    assert layer.weight_scale.shape == (96,) and (layer.weight_scale.unique().numel() > 1) == per_channel
    x = torch.randn(5, 160, generator=generator(14)).to(dtype)
    want = fp8_reference(x, layer.qweight, layer.weight_scale) + bias.float()
    out = layer(x)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == F32 else 1e-2
    assert torch.allclose(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    # the format's own error: within a few e4m3 steps (3 mantissa bits) of the exact product
    exact = x.float() @ weight.to(dtype).float().T + bias.float()
    assert (out.float() - exact).abs().max() <= 0.1 * exact.abs().max()


def test_fp8_falls_back_to_dequantized_weights_with_one_log_line(monkeypatch, caplog):
    from paged_runtime.layers.quantization import fp8

    def unavailable(*args, **kwargs):
        raise RuntimeError("_scaled_mm is not supported here")

    monkeypatch.setattr(torch, "_scaled_mm", unavailable)
    monkeypatch.setattr(fp8, "_fallback_logged", False)
    weight = torch.randn(32, 64, generator=generator(15))
    for _ in range(2):
        layer = RowParallelLinear(64, 32, False, Fp8LinearMethod(), F32, CPU)
        layer.weight_loader(layer.weight, weight)
        with caplog.at_level("WARNING", logger=fp8.__name__):
            layer.process_weights_after_loading()
        assert not layer.fp8_scaled_mm
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "_scaled_mm is unavailable" in caplog.records[0].message
    x = torch.randn(3, 64, generator=generator(16))
    assert torch.allclose(layer(x), x @ dequantize_fp8(layer.qweight, layer.weight_scale).T, rtol=1e-5, atol=1e-5)


def test_an_fp8_checkpoint_with_static_scales_loads_per_part():
    """Per-tensor weight scales of q, k, v become rows of one per-channel scale; their input scales one
    static scale (the largest)."""
    layer = QKVParallelLinear(64, 16, 2, 1, False, Fp8CheckpointMethod(static_input=True), F32, CPU)
    parts = []
    for i, (shard, rows) in enumerate([("q", 32), ("k", 16), ("v", 16)]):
        qweight, scale = quantize_fp8(torch.randn(rows, 64, generator=generator(17 + i)), per_channel=False)
        load(layer, {"weight": qweight, "weight_scale": scale[:1], "input_scale": torch.tensor([0.01 * (i + 1)])},
             shard)
        parts.append(dequantize_fp8(qweight, scale))
    layer.process_weights_after_loading()
    assert layer.input_scale.item() == pytest.approx(0.03)
    x = torch.randn(4, 64, generator=generator(20)) * 0.5
    xq, x_scale = quantize_activations(x, torch.tensor(0.03))
    assert torch.allclose(layer(x), (xq.float() * x_scale) @ torch.cat(parts).T, rtol=1e-5, atol=1e-5)


# ---- detection and refusals --------------------------------------------------------------------------------

def ct_config(kind: str, bits: int, strategy: str, fmt: str | None = None, inputs: dict | None = None,
              **weights) -> dict:
    fmt = fmt or {"int": "int-quantized" if bits == 8 else "pack-quantized", "float": "float-quantized"}[kind]
    args = {"type": kind, "num_bits": bits, "strategy": strategy, "symmetric": True, "dynamic": False,
            "group_size": 128 if strategy == "group" else None, **weights}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": inputs,
                                          "format": fmt}}}


def test_the_checkpoint_format_is_read_from_config_json():
    assert checkpoint_quantization({"hidden_size": 64}) is None
    assert checkpoint_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4}}) == "gptq"
    with pytest.raises(ValueError, match="'bitsandbytes'.*supported: gptq, awq, compressed-tensors"):
        checkpoint_quantization({"quantization_config": {"quant_method": "bitsandbytes"}})
    ignore_head = {**ct_config("int", 4, "group"), "ignore": ["re:.*lm_head", "model.embed_tokens"]}
    assert isinstance(compressed_tensors_method(ignore_head), CompressedInt4Method)
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    assert isinstance(linear_method("awq", TorchOps(), config), AWQLinearMethod)
    with pytest.raises(ValueError, match="checkpoint format"):
        linear_method("gptq", TorchOps())


@pytest.mark.parametrize("config, message", [
    ({"bits": 4, "group_size": 128, "desc_act": True}, "desc_act=true.*supported: desc_act=false"),
    ({"bits": 8, "group_size": 128}, "bits=8, group_size=128 is not supported; supported: bits=4"),
    ({"bits": 4, "group_size": 64}, "group_size=64"),
    ({"bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'.*supported: gptq, gptq_v2"),
])
def test_unsupported_gptq_checkpoints_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        gptq_method(config)


def test_unsupported_awq_checkpoints_are_refused():
    with pytest.raises(ValueError, match="version=gemv.*supported: bits=4, group_size=128, version=gemm"):
        awq_method({"bits": 4, "group_size": 128, "version": "GEMV", "zero_point": True})


@pytest.mark.parametrize("config, message", [
    (ct_config("int", 8, "group"), "weights int 8-bit group group_size=128"),
    (ct_config("int", 4, "group", group_size=32), "group_size=32"),
    (ct_config("int", 4, "group", actorder="group"), "not supported"),
    (ct_config("int", 8, "channel", inputs={"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True}),
     "input_activations=int 8-bit dynamic token"),
    (ct_config("float", 8, "block"), "float 8-bit block"),
    ({**ct_config("int", 4, "group"), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]},
     "ignores.*down_proj.*per-module exceptions"),
    ({**ct_config("int", 4, "group"), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_unsupported_compressed_tensors_schemes_are_refused_with_the_supported_ones(config, message):
    with pytest.raises(ValueError, match=message) as info:
        compressed_tensors_method(config)
    assert "W4A16" in str(info.value) or "ignores" in str(info.value)


def test_families_that_cannot_load_packed_tensors_are_refused(tmp_path):
    from paged_runtime.models.config import ModelConfig
    from paged_runtime.models.loader import resolve_quantization
    shape = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "quantization_config": {"quant_method": "gptq"}}
    for architecture, why in [("Phi3ForCausalLM", "fused in the checkpoint"), ("MixtralForCausalLM", "experts")]:
        config = ModelConfig.from_dict({**shape, "architectures": [architecture]})
        with pytest.raises(ValueError, match=f"gptq checkpoints of {architecture}.*{why}.*LlamaForCausalLM"):
            resolve_quantization(None, tmp_path, config)
    qwen3 = ModelConfig.from_dict({**shape, "architectures": ["Qwen3ForCausalLM"]})
    assert resolve_quantization("gptq", tmp_path, qwen3) == "gptq"
