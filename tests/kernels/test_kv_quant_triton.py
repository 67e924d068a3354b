"""Triton on an 8-bit paged KV cache (``--kv-cache-dtype fp8 / int8``) against the torch backend: the store
kernel quantizes bit for bit as ``kernels.kv_quant`` (values and int8 scales), and attention over the same
8-bit cache matches the torch backend's dequantized read (fp32: the interpreter computes bfloat16 wrongly),
including the C kernel where it loads. "fp8_bits" is the fp8 cache as a GPU without float8_e4m3fn in Triton
(Ampere) runs it: the kernels encode and decode its e4m3 bits themselves (``store_kv.fp8_native`` False)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from paged_runtime.attention import torch_backend
from paged_runtime.kernels import attention, kv_quant
from paged_runtime.kernels import store_kv as store_kv_module
from paged_runtime.kernels.attention import _fp8_value
from paged_runtime.kernels.store_kv import _e4m3_bits, store_kv

from .conftest import DEVICE
from .test_paged_attention import make_batch, ragged_lengths

pytestmark = [pytest.mark.kernels]

NAMES = ("fp8", "fp8_bits", "int8")


@pytest.fixture
def cache_name(request, monkeypatch) -> str:
    """The cache's --kv-cache-dtype; "fp8_bits": fp8, through the kernels as its bits (QUANT 3)."""
    if request.param == "fp8_bits":
        monkeypatch.setattr(store_kv_module, "fp8_native", lambda device: False)
        return "fp8"
    return request.param


def quantized_batch(name: str, seed: int, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                    block_size: int = 16):
    """A mixed ragged batch (decodes, prompts, prefix-hit chunks, verification rows) over an 8-bit cache whose
    cached context is ``make_batch``'s, quantized (its NaN-poisoned unwritten slots are zeros here: int8 has
    no NaN)."""
    query_lens, context_lens = ragged_lengths(seed, num_seqs=4, max_context=48)  # small: the interpreter is slow
    b = make_batch(seed, query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, torch.float32)
    cache = torch.zeros(b.cache.shape, dtype=kv_quant.cache_dtype(name, torch.float32), device=DEVICE)
    scale = kv_quant.allocate_scale(cache)
    if name == "fp8":
        scale.copy_(torch.tensor([0.25, 2.0]))
    written = torch.isfinite(b.cache).all(-1).all(-1).all(-1).nonzero().flatten()
    kv_quant.store(b.cache[written, 0], b.cache[written, 1], cache, scale, written)
    return b, cache, scale


@pytest.mark.parametrize("cache_name", NAMES, indirect=True)
def test_store_kernel_quantizes_as_the_torch_reference(cache_name):
    b, cache, scale = quantized_batch(cache_name, 0)
    ref_cache, ref_scale = cache.clone(), scale.clone()
    kv_quant.store(b.k, b.v, ref_cache, ref_scale, b.meta.slot_mapping)
    store_kv(b.k, b.v, cache, b.meta.slot_mapping, scale)
    assert torch.equal(kv_quant.as_bytes(cache), kv_quant.as_bytes(ref_cache))
    assert torch.equal(scale, ref_scale)


def test_store_kernel_skips_padding_slots():
    b, cache, scale = quantized_batch("int8", 1)
    before, before_scale = cache.clone(), scale.clone()
    store_kv(b.k, b.v, cache, torch.full_like(b.meta.slot_mapping, -1), scale)
    assert torch.equal(cache, before) and torch.equal(scale, before_scale)


@pytest.mark.parametrize("cache_name, num_splits", [("fp8", 1), ("fp8_bits", 1), ("fp8_bits", 3), ("int8", 1),
                                                     ("int8", 3)], indirect=["cache_name"])
def test_attention_over_the_8_bit_cache_matches_the_torch_backend(cache_name, num_splits):
    b, cache, scale = quantized_batch(cache_name, 2, num_heads=6, num_kv_heads=2)
    ref_cache, ref_scale = cache.clone(), scale.clone()
    ref = torch_backend.paged_attention(b.q, b.k, b.v, ref_cache, b.oracle_meta, 0.2, kv_scale=ref_scale)
    store_kv(b.k, b.v, cache, b.meta.slot_mapping, scale)
    out = attention.paged_attention(b.q, cache, b.meta.query_start_loc, b.meta.seq_lens, b.meta.block_tables,
                                    b.meta.block_size, b.meta.max_query_len, 0.2, num_splits, kv_scale=scale)
    assert torch.equal(kv_quant.as_bytes(cache), kv_quant.as_bytes(ref_cache))
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("cache_name", NAMES, indirect=True)
def test_triton_and_the_c_kernel_agree_on_decode_rows(cache_name):
    """The same 8-bit cache read by the three paths: torch (above), Triton and the compiled CPU kernel."""
    from paged_runtime.config import default_cache_dir
    from paged_runtime.kernels import cpu
    if DEVICE.type != "cpu" or not cpu.load(default_cache_dir()):
        pytest.skip("the CPU kernels need the CPU and a C compiler")
    b, cache, scale = quantized_batch(cache_name, 3)
    store_kv(b.k, b.v, cache, b.meta.slot_mapping, scale)
    out = attention.paged_attention(b.q, cache, b.meta.query_start_loc, b.meta.seq_lens, b.meta.block_tables,
                                    b.meta.block_size, b.meta.max_query_len, 0.2, 1, kv_scale=scale)
    last = b.meta.query_start_loc[1:].long() - 1  # each sequence's last query: one decode row over its context
    tables = b.meta.block_tables.long()
    rows = cpu.cpu_paged_decode_attention(b.q[last].contiguous(), cache, tables, b.meta.seq_lens.long(),
                                          b.meta.block_size, 0.2, kv_scale=scale)
    assert (rows - out[last]).abs().max().item() <= 1e-5


def test_the_e4m3_bits_decode_and_encode_every_value_as_torch():
    """QUANT 3's own codec against torch's float8_e4m3fn over all 254 values (the two NaN patterns aside:
    the store never writes one): bits -> fp32 exactly, and back to the same bits (zeros keep their sign)."""
    @triton.jit  # defined here, under the interpreter where there is no GPU (see conftest)
    def codec(bits_ptr, values_ptr, back_ptr):
        i = tl.arange(0, 256)
        value = _fp8_value(tl.load(bits_ptr + i), 3)
        tl.store(values_ptr + i, value)
        tl.store(back_ptr + i, _e4m3_bits(value))

    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bits[[0x7F, 0xFF]] = 0
    bits = bits.to(DEVICE)
    values = torch.empty(256, dtype=torch.float32, device=DEVICE)
    back = torch.empty_like(bits)
    codec[(1,)](bits, values, back)
    assert torch.equal(values, bits.view(torch.float8_e4m3fn).float())
    assert torch.equal(back, bits)
