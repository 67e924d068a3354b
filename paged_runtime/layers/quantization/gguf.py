"""GGUF weights served in their block formats (``gguf_blocks``): a ``LinearMethod`` for linear layers, the
embedding and the LM head.

A layer's checkpoint tensors are ``qweight`` (uint8 ``[rows, row_bytes]``, the file's blocks) and
``qweight_type`` (int64 ``[rows]``: each row's GGMLQuantizationType id), one pair per part of a fused matrix
(q / k / v, gate / up). Parts arrive in any order; ``process_weights_after_loading`` joins them into segments: one
segment when every part has the same type (one kernel call), else one per run of equal types (Q4_K_M files
hold attn_v in Q6_K beside q and k in Q4_K), whose outputs are concatenated.

Multiplying: on the CPU, the compiled kernels (``kernels.cpu`` ``cpu_gguf_linear``) read the blocks directly
for every batch; on CUDA, the Triton GEMM (``triton_gguf_linear``, ``kernels/quant_gemm.py``) reads them too,
each weight dequantized in registers; elsewhere (no compiler, no Triton) each segment is dequantized per call
(the torch definition) and multiplied by ``F.linear``. No dequantized copy is kept: the memory stays the
file's. Where the CPU kernels run, segments of whole 8-row groups (every type) are repacked at load
(``gguf_pack_x8``: the same bytes, an output row per vector lane), which batches multiply 1.5-2.8x faster
(Q4_1, 16-128 rows). A tied embedding and LM head share one repacked matrix (the embedding dequantizes the 8-row group of each id it looks up).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from paged_runtime.kernels import triton_ops
from paged_runtime.layers.linear import LinearMethod
from paged_runtime.layers.quantization.base import triton_applies
from paged_runtime.layers.quantization.gguf_blocks import GgufType, dequantize, served_type

# Every batch goes through the kernels, float32 too, where dequantize + GEMM
# would win above ~32 rows: one arithmetic for every batch size, so a request's tokens never depend on what it
# is batched with (chunked prefill, prefix hits, preemption). In bfloat16 the kernels are also the faster at
# every size measured (1536 x 576 Q4_1, 16-512 rows, one thread on a 2-core AMD EPYC without AVX-512: 3-6x
# torch's bf16 GEMM, which has no native bf16 arithmetic there).


class GGUFLinearMethod(LinearMethod):
    """``kernels``: the compiled CPU ops (``paged_runtime.kernels.cpu``) when they loaded, else None.
    ``repack``: whether blocks are repacked for the kernels where they can be (see above)."""

    def __init__(self, kernels=None, repack: bool = True) -> None:
        self.kernels, self.repack = kernels, repack
        # (file tensor, its packing): a tied embedding and LM head pack once; weak, so the file's bytes go
        self._packed_of: list[tuple[weakref.ref, tuple[torch.Tensor, int]]] = []

    def describe(self, layer: nn.Module) -> list[tuple[torch.Tensor, int]] | None:
        """The compiled decode step multiplies blocks as ``cpu_gguf_linear`` does (the same bits), so it takes
        them wherever these kernels run."""
        if self.kernels is None:
            return None
        return [(raw, kernel_id) for _, kernel_id, raw in self.segments(layer)]

    def vocab_method(self) -> LinearMethod:
        return GGUFLinearMethod(self.kernels, self.repack)  # the embedding and LM head keep their blocks too

    def create_weights(self, layer: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        if layer.tp.size > 1:
            raise ValueError("GGUF block weights are served on one tensor-parallel rank; pass --quantization "
                             "none to dequantize them for tensor parallelism")
        layer.gguf_dtype, layer.gguf_parts = dtype, {}
        for name in ("qweight", "qweight_type"):  # placeholders the model's loader finds by name
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device), requires_grad=False)
            param.weight_loader = self._part_loader(layer, name)
            setattr(layer, name, param)

    @staticmethod
    def _part_loader(layer: nn.Module, name: str):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            layer.gguf_parts.setdefault(shard_id, {})[name] = loaded.to(param.device)
        return load

    def tie(self, layer: nn.Module, embedding: nn.Module) -> None:
        layer.gguf_parts = embedding.gguf_parts  # the same blocks, joined without a copy (one part)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [layer.gguf_parts[key] for key in _part_order(layer.gguf_parts)]
        del layer.qweight, layer.qweight_type
        layer.gguf_segments = []
        for qtype, raws in _runs(parts):
            rows, row_bytes = sum(len(r) for r in raws), raws[0].shape[1]
            k = row_bytes // qtype.block_bytes * qtype.block_elems
            if k != layer.input_size:
                raise ValueError(f"GGUF {qtype.name} rows hold {k} inputs, the layer takes {layer.input_size}")
            raw = raws[0] if len(raws) == 1 else torch.cat(raws)
            raw, kernel_id = self._packed(layer, raw, qtype, k)
            layer.register_buffer(f"qweight_{len(layer.gguf_segments)}", raw)
            layer.gguf_segments.append((qtype, rows, kernel_id))
        del layer.gguf_parts  # the file's tensors, where repacked, are freed here

    def _packed(self, layer: nn.Module, raw: torch.Tensor, qtype: GgufType, k: int) -> tuple[torch.Tensor, int]:
        """The segment as the kernels will read it, and the type id they read it under."""
        if not (self.repack and self._kernels_take(raw, layer.gguf_dtype)):
            return raw, qtype.id
        for source, packed in self._packed_of:
            if source() is raw:  # the LM head tied to the embedding: one matrix
                return packed
        packed = self.kernels.gguf_pack_x8(raw, qtype.id, k)
        if packed is None:
            return raw, qtype.id
        self._packed_of.append((weakref.ref(raw), packed))
        return packed

    def segments(self, layer: nn.Module):
        """(type, kernel type id, blocks) per segment: the id has the packed flag where the blocks are."""
        for i, (qtype, _, kernel_id) in enumerate(layer.gguf_segments):
            yield qtype, kernel_id, getattr(layer, f"qweight_{i}")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        outs = [self._multiply(x, raw, qtype, kernel_id) for qtype, kernel_id, raw in self.segments(layer)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], out.shape[-1])

    def _multiply(self, x: torch.Tensor, raw: torch.Tensor, qtype: GgufType, kernel_id: int) -> torch.Tensor:
        k = x.shape[-1]
        if self._kernels_take(x):  # the kernels read the blocks for every batch size
            return self.kernels.cpu_gguf_linear(x.contiguous(), raw, None, kernel_id, k)
        if triton_applies(x) and kernel_id == qtype.id:  # (blocks are repacked only where the CPU kernels run)
            return triton_ops.gguf_linear(x.contiguous(), raw, qtype.id)
        return F.linear(x, self._dequantize(raw, qtype, kernel_id, k, x.dtype))

    def _kernels_take(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        return self.kernels is not None and t.device.type == "cpu" and (dtype or t.dtype) in self.kernels.DTYPES

    def _dequantize(self, raw: torch.Tensor, qtype: GgufType, kernel_id: int, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
        if self._kernels_take(raw, dtype):
            return self.kernels.cpu_gguf_dequantize(raw, kernel_id, k, dtype)
        if kernel_id != qtype.id:  # packed: only the kernels read it
            return self.kernels.cpu_gguf_dequantize(raw, kernel_id, k, torch.float32).to(dtype)
        return dequantize(raw, qtype, dtype)

    def embed(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        (qtype, kernel_id, raw), = self.segments(layer)
        k = layer.input_size
        if kernel_id == qtype.id:
            return self._dequantize(raw[input_ids], qtype, kernel_id, k, layer.gguf_dtype)
        groups = raw.view(-1, 8 * raw.shape[1])[input_ids // 8].view(-1, raw.shape[1])  # each id's 8 rows
        rows = self._dequantize(groups, qtype, kernel_id, k, layer.gguf_dtype).view(-1, 8, k)
        return rows[torch.arange(len(input_ids), device=rows.device), input_ids % 8]


def _part_order(parts: dict) -> list:
    """Fused parts in their matrix order (q, k, v; 0, 1, ...; None for a whole matrix)."""
    qkv = {"q": 0, "k": 1, "v": 2}
    return sorted(parts, key=lambda key: qkv.get(key, key if isinstance(key, int) else 0))


def _runs(parts: list[dict]) -> list[tuple[GgufType, list[torch.Tensor]]]:
    """Consecutive parts of one type, grouped: [(type, [raw, ...]), ...]."""
    runs: list[tuple[GgufType, list[torch.Tensor]]] = []
    for part in parts:
        qtype = served_type(int(part["qweight_type"].reshape(-1)[0]))
        raw = part["qweight"]
        if runs and runs[-1][0] == qtype:
            runs[-1][1].append(raw)
        else:
            runs.append((qtype, [raw]))
    return runs
