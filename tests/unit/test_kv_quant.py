"""The paged KV cache in another dtype than the model's (``--kv-cache-dtype fp8 / int8``, and ``bfloat16``
under float32 activations): the torch reference's round trip, the compiled CPU kernels against it on the same
cache (store bit for bit, attention to float32 summation order), the budget's exact bytes per block, and bad
names refused with the choices."""
from __future__ import annotations

import os

import pytest
import torch

from paged_runtime.attention.torch_backend import AttentionMetadata, decode_group, paged_attention
from paged_runtime.config import KV_CACHE_DTYPES, EngineConfig, default_cache_dir
from paged_runtime.kernels import cpu, kv_quant

E4M3 = torch.float8_e4m3fn
QUANTIZED = ("fp8", "int8")
DTYPES = (torch.float32, torch.bfloat16)
# (cache name, model dtype) of every cache the model's K/V are converted for: 8 bits under either activation
# dtype, and bfloat16 under float32 (under bfloat16 it is the model's own: "auto").
CONVERTED = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}") for name in QUANTIZED for dtype in DTYPES]
CONVERTED.append(pytest.param("bfloat16", torch.float32, id="bfloat16-float32"))


def randn(*shape: int, seed: int = 0, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def empty_cache(name: str, num_slots: int, kv_heads: int, dim: int, dtype=torch.float32):
    cache = torch.zeros(num_slots, 2, kv_heads, dim, dtype=kv_quant.cache_dtype(name, dtype))
    return cache, kv_quant.allocate_scale(cache)


# ---- the torch reference ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_round_trip_is_within_half_a_step_of_each_heads_scale(dtype):
    k, v = randn(40, 3, 64, seed=1, std=3).to(dtype), randn(40, 3, 64, seed=2).to(dtype)
    k[5, 1] = 0  # an all-zero head: scale 0, reads back 0
    cache, scale = empty_cache("int8", 64, 3, 64, dtype)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:40]
    kv_quant.store(k, v, cache, scale, slots)
    x = torch.stack((k, v), dim=1).float()
    assert torch.equal(scale[slots], x.abs().amax(-1) / 127)
    back = kv_quant.gather(cache, scale, slots, torch.float32)
    # A tie (x / scale = n + 0.5 exactly) is half a step away; + one float32 step of x for the arithmetic.
    assert ((x - back).abs() <= scale[slots][..., None] / 2 + x.abs() * 2 ** -23).all()
    assert cache[slots].abs().amax(-1)[scale[slots] > 0].eq(127).all()  # each head's absmax maps to +-127
    assert torch.equal(back[5, 0, 1], torch.zeros(64))


def test_fp8_stores_torchs_own_e4m3_rounding_of_x_over_the_scale_saturated():
    k, v = randn(20, 2, 16, seed=4, std=100), randn(20, 2, 16, seed=5, std=0.01)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448.0, 1e-9])  # beyond e4m3's range saturates, tiny stays subnormal
    cache, scale = empty_cache("fp8", 32, 2, 16)
    scale.copy_(torch.tensor([2.0, 0.5]))  # (k_scale, v_scale)
    slots = torch.arange(20) + 7
    kv_quant.store(k, v, cache, scale, slots)
    want_k = (k / 2.0).clamp(-448, 448).to(E4M3)
    want_v = (v / 0.5).clamp(-448, 448).to(E4M3)
    assert torch.equal(cache[slots, 0].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(cache[slots, 1].view(torch.uint8), want_v.view(torch.uint8))
    assert cache[7, 0, 0, :2].float().tolist() == [448.0, -448.0]
    back = kv_quant.gather(cache, scale, slots, torch.float32)
    assert torch.equal(back[:, 0], want_k.float() * 2.0) and torch.equal(back[:, 1], want_v.float() * 0.5)


def test_a_bfloat16_cache_stores_torchs_rounding_and_reads_it_back_exactly():
    """Under float32 activations: each value rounded to nearest even once, on store; read back widened (exact)."""
    k, v = randn(20, 2, 16, seed=4, std=3), randn(20, 2, 16, seed=5)
    cache, scale = empty_cache("bfloat16", 32, 2, 16)
    assert cache.dtype == torch.bfloat16 and scale is None
    slots = torch.arange(20) + 7
    kv_quant.store(k, v, cache, scale, slots)
    assert torch.equal(cache[slots], torch.stack((k, v), dim=1).to(torch.bfloat16))
    back = kv_quant.gather(cache, scale, slots, torch.float32)
    assert back.dtype == torch.float32 and torch.equal(back, cache[slots].float())
    assert not torch.equal(back, torch.stack((k, v), dim=1))  # it did round
    assert kv_quant.cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16  # the model's own: as auto
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 needs float32 or bfloat16 activations"):
        kv_quant.cache_dtype("bfloat16", torch.float16)  # fewer fraction bits than the model's, no bytes saved


def test_auto_is_the_model_dtype_untouched():
    cache, scale = empty_cache("auto", 8, 1, 4, torch.bfloat16)
    assert cache.dtype == torch.bfloat16 and scale is None
    assert kv_quant.cache_dtype("fp8_e4m3", torch.float16) == E4M3


# ---- budget -------------------------------------------------------------------------------------

def test_bytes_per_block_count_the_8_bit_values_and_int8_scales_exactly():
    from torch import nn
    from paged_runtime.layers.attention import Attention
    from paged_runtime.worker.kv_budget import bytes_per_block, num_kv_blocks
    model = nn.ModuleList([Attention(9, 3, 64, 0.125) for _ in range(30)])  # SmolLM2-135M's attention
    per_block = {name: bytes_per_block([model], 16, torch.bfloat16, name) for name in KV_CACHE_DTYPES}
    assert per_block["auto"] == 30 * 16 * 2 * 3 * 64 * 2 == 368640
    assert per_block["fp8"] == per_block["fp8_e4m3"] == 368640 // 2
    assert per_block["int8"] == 30 * 16 * 3 * (2 * 64 + 2 * 4) == 195840  # + a float32 scale per K/V head row
    assert per_block["bfloat16"] == 368640  # the model's own dtype here
    assert bytes_per_block([model], 16, torch.float32, "bfloat16") == 368640  # half float32's
    assert bytes_per_block([model], 16, torch.float32, "auto") == 2 * 368640
    budget = 64 << 20
    blocks = {name: num_kv_blocks(per_block[name], 16, budget, 2048, 256) for name in ("auto", "fp8", "int8")}
    assert blocks == {"auto": 182, "fp8": 364, "int8": 342}


# ---- the compiled CPU kernels on the same converted cache -----------------------------------------

kernels = pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")


def filled_cache(name: str, dtype: torch.dtype, num_blocks: int, block_size: int, kv_heads: int, dim: int, seed: int):
    cache, scale = empty_cache(name, num_blocks * block_size, kv_heads, dim, dtype)
    if name == "fp8":
        scale.copy_(torch.tensor([0.5, 1.5]))
    k, v = (randn(num_blocks * block_size, kv_heads, dim, seed=seed + i).to(dtype) for i in range(2))
    kv_quant.store(k, v, cache, scale, torch.arange(num_blocks * block_size))
    return cache, scale


@kernels
@pytest.mark.parametrize("name,dtype", CONVERTED)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 40)])
def test_c_decode_attention_reads_the_converted_cache_as_the_torch_backend(name, dtype, heads, kv_heads, dim):
    block_size, num_blocks = 16, 24
    cache, scale = filled_cache(name, dtype, num_blocks, block_size, kv_heads, dim, seed=heads + dim)
    g = torch.Generator().manual_seed(dim)
    lens = torch.tensor([1, 16, 17, 90, 200])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:13] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    out = cpu.cpu_paged_decode_attention(q, cache, tables, lens, block_size, dim ** -0.5, kv_scale=scale)
    t = torch.arange(int(lens.max()))
    gather = tables[:, t // block_size] * block_size + t % block_size
    group = decode_group(0, gather, lens)
    ref = group.attend(q.float(), cache, dim ** -0.5, kv_scale=scale)  # dequantized in fp32
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - ref).abs().max() <= tolerance


# Every cache the kernel reads: the model dtype's own ("auto") and each converted one.
EVERY_CACHE = [pytest.param("auto", t, id=f"auto-{str(t)[6:]}") for t in DTYPES] + CONVERTED


def any_cache(name: str, dtype: torch.dtype, num_blocks: int, block_size: int, kv_heads: int, dim: int, seed: int):
    if name == "auto":
        return randn(num_blocks * block_size, 2, kv_heads, dim, seed=seed).to(dtype), None
    return filled_cache(name, dtype, num_blocks, block_size, kv_heads, dim, seed=seed)


@kernels
@pytest.mark.parametrize("name,dtype", EVERY_CACHE)
def test_c_decode_attention_gives_whole_rows_the_bits_of_rows_by_kv_head(name, dtype):
    """80 rows take whole-row items (4 a thread, up to 20 threads), 5 rows (row, KV head) items: each head's
    arithmetic is the same sequence either way, so the bits are too."""
    heads, kv_heads, dim, block_size, num_blocks = 9, 3, 64, 16, 24
    cache, scale = any_cache(name, dtype, num_blocks, block_size, kv_heads, dim, seed=5)
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, 16, 17, 90, 200] * 16)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:13] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    whole = cpu.cpu_paged_decode_attention(q, cache, tables, lens, block_size, 0.125, kv_scale=scale)
    by_head = torch.cat([cpu.cpu_paged_decode_attention(q[i:i + 5], cache, tables[i:i + 5], lens[i:i + 5], block_size,
                                                        0.125, kv_scale=scale) for i in range(0, len(lens), 5)])
    assert torch.equal(whole, by_head)


@kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no team to share a row")
@pytest.mark.parametrize("name,dtype,window,softcap,heads,kv_heads,dim",
                         [pytest.param(*p.values, 0, 0., 9, 3, 64, id=p.id) for p in EVERY_CACHE] +
                         [pytest.param("auto", torch.float32, 700, 0., 9, 3, 64, id="window"),
                          pytest.param("auto", torch.float32, 0, 5., 9, 3, 64, id="softcap"),
                          pytest.param("auto", torch.bfloat16, 0, 0., 8, 1, 128, id="8-heads-a-kv-head")])
def test_c_decode_attention_gives_a_long_row_alone_the_bits_it_gets_among_others(name, dtype, window, softcap, heads,
                                                                                 kv_heads, dim):
    """A step of one long row whose KV heads do not split evenly over the threads (3 or 1 over 2) is attended by
    the whole team: each thread scores a share of its tokens, softmaxes a share of its heads and sums a share of
    every head's value dims. Each value takes the same operations as when one thread attends a KV head (the row
    beside another, (row, KV head) items), so the bits are the same; a share lost or summed twice would not be."""
    block_size, num_blocks = 16, 72
    cache, scale = any_cache(name, dtype, num_blocks, block_size, kv_heads, dim, seed=9)
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([1000, 257, 300])  # 1000 and 257: not whole runs of 16 tokens
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:64] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    attend = lambda rows: cpu.cpu_paged_decode_attention(q[rows], cache, tables[rows], lens[rows], block_size,  # noqa: E731
                                                         0.125, window, softcap, kv_scale=scale)
    for row in range(2):
        assert torch.equal(attend([row]), attend([row, 2])[:1])


@kernels
@pytest.mark.parametrize("name,dtype,window,softcap,heads,kv_heads,dim",
                         [pytest.param(*p.values, 0, 0., 9, 3, 64, id=p.id) for p in EVERY_CACHE] +
                         [pytest.param("auto", torch.float32, 20, 0., 9, 3, 64, id="window"),
                          pytest.param("auto", torch.float32, 0, 5., 9, 3, 64, id="softcap"),
                          pytest.param("auto", torch.float32, 0, 0., 8, 2, 128, id="4-heads-a-kv-head"),
                          pytest.param("auto", torch.float32, 0, 0., 8, 1, 48, id="8-heads-a-kv-head")])
def test_c_attention_gives_a_prompt_chunks_rows_in_tiles_the_bits_of_each_row_alone(name, dtype, window, softcap,
                                                                                      heads, kv_heads, dim):
    """Consecutive rows that read the same slots (a prompt chunk's tokens: 21 of one request, then 38 of
    another, then 19 of a third that shares the second's first two blocks but not its third) are attended in
    tiles of up to 8 rows that read each key and value once for all of them (3, 4 and 8 query heads a KV
    head); each row's arithmetic is its own alone, so one call gives the bits of a call per row. A tile that
    crossed into the third request (its block table equal on the shared prefix) would give its rows the second
    one's keys."""
    block_size, num_blocks = 16, 24
    cache, scale = any_cache(name, dtype, num_blocks, block_size, kv_heads, dim, seed=7)
    g = torch.Generator().manual_seed(2)
    first, second = torch.randperm(num_blocks, generator=g)[:12], torch.randperm(num_blocks, generator=g)[:12]
    third = torch.cat([second[:2], first[2:]])  # shares the second's first two blocks
    lens = torch.cat([torch.arange(1, 22), torch.arange(131, 169), torch.arange(36, 55)])
    tables = torch.stack([first] * 21 + [second] * 38 + [third] * 19)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    attend = lambda rows: cpu.cpu_paged_decode_attention(q[rows], cache, tables[rows], lens[rows], block_size,  # noqa: E731
                                                         0.125, window, softcap, kv_scale=scale)
    alone = torch.cat([attend(slice(i, i + 1)) for i in range(len(lens))])
    assert torch.equal(attend(slice(None)), alone)


@kernels
@pytest.mark.parametrize("name,dtype,window,softcap,heads,kv_heads,dim",
                         [pytest.param(*p.values, 0, 0., 9, 3, 64, id=p.id) for p in EVERY_CACHE] +
                         [pytest.param("auto", torch.float32, 20, 0., 9, 3, 64, id="window"),
                          pytest.param("auto", torch.float32, 0, 5., 9, 3, 64, id="softcap"),
                          pytest.param("auto", torch.float32, 0, 0., 8, 2, 128, id="4-heads-a-kv-head")])
def test_c_prompt_attention_reads_every_cache_as_the_rows_do(name, dtype, window, softcap, heads, kv_heads, dim):
    """The flash kernel packs a chunk's context as the row kernel reads it (an 8-bit cache's values times
    their scales, in fp32; a bfloat16 cache widened), windowed and soft-capped alike: the chunk's rows agree
    with the row kernel's within fp32 summation order (bfloat16: a rounding of the output)."""
    block_size, num_blocks, context, queries = 16, 16, 230, 150
    cache, scale = any_cache(name, dtype, num_blocks, block_size, kv_heads, dim, seed=11)
    g = torch.Generator().manual_seed(3)
    table = torch.randperm(num_blocks, generator=g)
    q = torch.randn(queries, heads, dim, generator=g).to(dtype)
    out = cpu.cpu_paged_prompt_attention(q, cache, table, context, block_size, 0.125, window, softcap, scale)
    rows = cpu.cpu_paged_decode_attention(q, cache, table.expand(queries, -1), torch.arange(81, 231), block_size,
                                          0.125, window, softcap, kv_scale=scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - rows.float()).abs().max() <= tolerance


@kernels
def test_c_kernel_refuses_an_8_bit_cache_without_its_scales():
    cache, _ = empty_cache("int8", 16, 1, 16)
    with pytest.raises(ValueError, match="needs its contiguous float32 kv_scale"):
        cpu.cpu_paged_decode_attention(torch.zeros(1, 1, 16), cache, torch.zeros(1, 1, dtype=torch.int64),
                                       torch.tensor([1]), 16, 0.25)


@kernels
def test_c_kernel_refuses_a_cache_it_cannot_read_under_the_query_dtype():
    """A float32 cache under bfloat16 queries: no such cache is ever allocated, and none is read as another."""
    with pytest.raises(ValueError, match="torch.float32 KV cache under torch.bfloat16"):
        cpu.cpu_paged_decode_attention(torch.zeros(1, 1, 16, dtype=torch.bfloat16), torch.zeros(16, 2, 1, 16),
                                       torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]), 16, 0.25)


@kernels
@pytest.mark.parametrize("name,dtype", CONVERTED)
def test_the_compiled_decode_step_stores_the_same_converted_cache_as_torch(name, dtype):
    """The compiled decode step converts its K/V exactly as ``kv_quant.store`` (same bits, same scales) and attends
    as the layer on PyTorch ops does over the same converted cache."""
    from paged_runtime.layers.linear import UnquantizedLinearMethod
    from paged_runtime.layers.ops import TorchOps
    from paged_runtime.layers.rotary import RotaryEmbedding
    from paged_runtime.models.config import ModelConfig
    from paged_runtime.models.llama import LlamaDecoderLayer
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-6})
    device, ops = torch.device("cpu"), TorchOps()
    rope = RotaryEmbedding(16, 512, config.rope_theta, None, ops, device)
    layer = LlamaDecoderLayer(config, rope, ops, UnquantizedLinearMethod(ops), dtype, device)
    g = torch.Generator().manual_seed(7)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    rows, block_size = 5, 16
    lens = torch.tensor([1, 40, 200, 17, 33])
    tables = torch.randperm(80, generator=g).view(5, 16)
    positions = lens - 1
    slots = tables[torch.arange(rows), positions // block_size] * block_size + positions % block_size
    cache, scale = filled_cache(name, dtype, 80, block_size, 2, 16, seed=9)
    x, residual = (torch.randn(rows, 96, generator=g).to(dtype) for _ in range(2))
    t = torch.arange(int(lens.max()))
    meta = AttentionMetadata(slots, [decode_group(0, tables[:, t // block_size] * block_size + t % block_size,
                                                  lens)], [])
    attn = layer.self_attn.attn
    attn.kv_cache, attn.kv_scale = ref_cache, ref_scale = cache.clone(), None if scale is None else scale.clone()
    ref_x, ref_residual = layer(x, residual.clone(), rope.inputs(positions, dtype), meta)

    plain = torch.zeros(cache.shape, dtype=dtype)  # the same layer with a model-dtype cache: the K/V it stores
    step = (positions, slots, tables, lens, block_size)
    attn.kv_cache, attn.kv_scale = plain, None
    cpu.DecodeStack([layer.describe()], dtype).run(x.clone(), residual.clone(), *step)
    attn.kv_cache, attn.kv_scale = cache, scale
    cpu.DecodeStack([layer.describe()], dtype).run(x, residual, *step)
    want, want_scale = kv_quant.quantize(plain[slots], cache, scale)
    assert torch.equal(kv_quant.as_bytes(cache[slots]), kv_quant.as_bytes(want))  # quantized bit for bit
    if want_scale is not None:
        assert torch.equal(scale[slots], want_scale)
    others = torch.ones(len(cache), dtype=torch.bool).index_fill_(0, slots, False)
    assert torch.equal(kv_quant.as_bytes(cache[others]), kv_quant.as_bytes(ref_cache[others]))
    # The K/V themselves come from the kernels' own qkv product (another summation order than PyTorch's).
    assert torch.allclose(kv_quant.gather(cache, scale, slots, torch.float32),
                          kv_quant.gather(ref_cache, ref_scale, slots, torch.float32), rtol=0.07, atol=0.02)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -5
    assert (x.float() - ref_x.float()).abs().max() <= tolerance * ref_x.float().abs().max()


# ---- the torch backend reads what it stored -------------------------------------------------------

@pytest.mark.parametrize("name", QUANTIZED + ("bfloat16",))
def test_a_whole_prompt_attends_to_its_stored_converted_kv(name):
    """A float32 prompt without cached context attends over its cache rows read back (as Triton and the C kernel
    read the cache), so a later prefix-cache hit sees exactly what the first request saw."""
    from paged_runtime.attention.torch_backend import PrefillChunk, _attend
    q, k, v = randn(6, 4, 32, seed=1), randn(6, 2, 32, seed=2), randn(6, 2, 32, seed=3)
    cache, scale = empty_cache(name, 16, 2, 32)
    slots = torch.tensor([3, 4, 5, 8, 9, 10])
    out = paged_attention(q, k, v, cache, AttentionMetadata(slots, [], [PrefillChunk(0, 6, None, None, 6)]),
                          0.2, kv_scale=scale)
    back = kv_quant.gather(cache, scale, slots, torch.float32)
    assert torch.equal(out, _attend(q, back[:, 0], back[:, 1], None, 0.2))


# ---- names ----------------------------------------------------------------------------------------

def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices(capsys):
    from paged_runtime.entrypoints.cli import build_parser
    assert KV_CACHE_DTYPES == tuple(kv_quant.CACHE_DTYPES)
    with pytest.raises(ValueError,
                       match="kv_cache_dtype must be one of auto, bfloat16, fp8, fp8_e4m3, int8; got 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp4'" in err and all(f"'{n}'" in err for n in KV_CACHE_DTYPES), err
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.cache_dtype("e5m2", torch.float32)
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"


def test_the_adapters_pass_the_kv_cache_dtype_to_the_engine():
    pytest.importorskip("pydantic")
    from rayserve_adapter.args import AppArgs
    assert AppArgs(kv_cache_dtype="fp8").engine_config().kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        AppArgs(kv_cache_dtype="fp4")
    kserve_args = pytest.importorskip("kserve_adapter.args")
    assert kserve_args.build_parser().parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


@kernels
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_gather_reads_what_the_torch_gather_reads(name, dtype):
    """``cpu_kv_gather`` (the torch backend's read on the CPU once the kernels load) is bit for bit the
    PyTorch dequantization, fp8 with and without its scales."""
    cache, scale = filled_cache(name, dtype, 6, 16, 3, 40, seed=11)
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:50]
    values = kv_quant.as_bytes(cache).index_select(0, slots).view(cache.dtype)
    scales = scale.index_select(0, slots) if name == "int8" else scale
    assert torch.equal(cpu.cpu_kv_gather(cache, scale, slots, dtype), kv_quant.dequantize(values, scales, dtype))
    if name == "fp8":
        assert torch.equal(cpu.cpu_kv_gather(cache, None, slots, dtype), values.to(dtype))
