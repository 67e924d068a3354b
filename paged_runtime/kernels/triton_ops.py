"""The Triton kernels as ``paged_runtime::`` ops: ``triton_store_kv``, ``triton_paged_attention`` and the
fused layer ops of ``TritonOps`` (``triton_rms_norm``, ``triton_add_rms_norm``, ``triton_rope_``,
``triton_silu_mul``; ``kernels/fused.py``), LoRA's shrink and expand, ``triton_lora_delta``
(``kernels/lora.py``), and the weight-only quantized GEMMs ``triton_w8a16_linear`` / ``triton_w4a16_linear`` /
``triton_gguf_linear`` (``kernels/quant_gemm.py``).

Defining the ops imports no Triton: each implementation imports its kernel module
on first call (see ``paged_runtime.kernels`` for why). They are registered for
every device (CompositeExplicitAutograd): CUDA in production, the CPU under
``TRITON_INTERPRET=1`` in the tests.
"""
from __future__ import annotations

import torch

LIB = torch.library.Library("paged_runtime", "FRAGMENT")

LIB.define("triton_store_kv(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
           "Tensor(b!)? kv_scale=None) -> ()")
LIB.define("triton_paged_attention(Tensor q, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
           "Tensor block_tables, int block_size, int max_query_len, float scale, int num_kv_splits, int window=0, "
           "float softcap=0., Tensor? kv_scale=None) -> Tensor")
LIB.define("triton_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
LIB.define("triton_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)")
LIB.define("triton_rope_(Tensor(a!) qkv, int num_heads, int head_dim, Tensor positions, Tensor cos, Tensor sin) -> ()")
LIB.define("triton_silu_mul(Tensor gate_up) -> Tensor")
LIB.define("triton_lora_delta(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor row_slots, int[] slices) -> ()")
LIB.define("triton_w8a16_linear(Tensor x, Tensor qweight, Tensor scale) -> Tensor")
LIB.define("triton_w4a16_linear(Tensor x, Tensor qweight, Tensor scales_and_zeros) -> Tensor")
LIB.define("triton_gguf_linear(Tensor x, Tensor raw, int qtype) -> Tensor")


def _store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              kv_scale: torch.Tensor | None = None) -> None:
    from paged_runtime.kernels.store_kv import store_kv
    store_kv(k, v, kv_cache, slot_mapping, kv_scale)


def _paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_query_len: int,
                     scale: float, num_kv_splits: int, window: int = 0, softcap: float = 0.,
                     kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    from paged_runtime.kernels.attention import paged_attention
    return paged_attention(q, kv_cache, query_start_loc, seq_lens, block_tables, block_size, max_query_len,
                           scale, num_kv_splits, window=window, softcap=softcap, kv_scale=kv_scale)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from paged_runtime.kernels.fused import rms_norm
    return rms_norm(x, weight, eps)[0]


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from paged_runtime.kernels.fused import rms_norm
    return rms_norm(x, weight, eps, residual)


def _rope(qkv: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    from paged_runtime.kernels.fused import rope_
    rope_(qkv, num_heads, head_dim, positions, cos, sin)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    from paged_runtime.kernels.fused import silu_mul
    return silu_mul(gate_up)


def _lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                slices: list[int]) -> None:
    from paged_runtime.kernels.lora import lora_delta
    lora_delta(y, x, a, b, row_slots, slices)


def _w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from paged_runtime.kernels.quant_gemm import w8a16_linear
    return w8a16_linear(x, qweight, scale)


def _w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    from paged_runtime.kernels.quant_gemm import w4a16_linear
    return w4a16_linear(x, qweight, scales_and_zeros)


def _gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    from paged_runtime.kernels.quant_gemm import gguf_linear
    return gguf_linear(x, raw, qtype)


LIB.impl("triton_store_kv", _store_kv, "CompositeExplicitAutograd")
LIB.impl("triton_paged_attention", _paged_attention, "CompositeExplicitAutograd")
torch.library.register_fake("paged_runtime::triton_store_kv", lambda k, v, kv_cache, slot_mapping, kv_scale=None: None,
                            lib=LIB)
torch.library.register_fake("paged_runtime::triton_paged_attention",
                            lambda q, *args: torch.empty_like(q), lib=LIB)

for _name, _impl in (("triton_rms_norm", _rms_norm), ("triton_add_rms_norm", _add_rms_norm),
                     ("triton_rope_", _rope), ("triton_silu_mul", _silu_mul), ("triton_lora_delta", _lora_delta),
                     ("triton_w8a16_linear", _w8a16_linear), ("triton_w4a16_linear", _w4a16_linear),
                     ("triton_gguf_linear", _gguf_linear)):
    LIB.impl(_name, _impl, "CompositeExplicitAutograd")
torch.library.register_fake("paged_runtime::triton_rms_norm", lambda x, weight, eps: torch.empty_like(x), lib=LIB)
torch.library.register_fake("paged_runtime::triton_add_rms_norm",
                            lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)), lib=LIB)
torch.library.register_fake("paged_runtime::triton_rope_", lambda qkv, *args: None, lib=LIB)
torch.library.register_fake("paged_runtime::triton_silu_mul",
                            lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2), lib=LIB)
torch.library.register_fake("paged_runtime::triton_lora_delta", lambda y, *args: None, lib=LIB)
for _name in ("triton_w8a16_linear", "triton_w4a16_linear", "triton_gguf_linear"):
    torch.library.register_fake(f"paged_runtime::{_name}",
                                lambda x, qweight, _: x.new_empty(x.shape[0], qweight.shape[0]), lib=LIB)

store_kv = torch.ops.paged_runtime.triton_store_kv
paged_attention = torch.ops.paged_runtime.triton_paged_attention
rms_norm = torch.ops.paged_runtime.triton_rms_norm
add_rms_norm = torch.ops.paged_runtime.triton_add_rms_norm
rope_ = torch.ops.paged_runtime.triton_rope_
silu_mul = torch.ops.paged_runtime.triton_silu_mul
lora_delta = torch.ops.paged_runtime.triton_lora_delta
w8a16_linear = torch.ops.paged_runtime.triton_w8a16_linear
w4a16_linear = torch.ops.paged_runtime.triton_w4a16_linear
gguf_linear = torch.ops.paged_runtime.triton_gguf_linear


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int) -> int:
    """The split-KV rule of the attention kernel at this device's SM count (host integers only; the SM
    count is read once, so a CUDA graph captured per batch size keeps its segment count)."""
    from paged_runtime.kernels.attention import num_kv_splits as rule
    return rule(num_seqs, num_kv_heads, max_query_len, max_seq_len)
