"""A decoder layer's operations, on two paths the model picks between at load time.

- ``TorchOps``: plain PyTorch with Hugging Face's numerics step for step (RMSNorm in
  fp32, rotate-half RoPE, SwiGLU); every device; the oracle for the other path.
- ``CpuKernelOps``: the compiled CPU kernels of ``paged_runtime.kernels.cpu``. A
  decode step's few rows stream each weight matrix once (``linear``); norm, RoPE
  and SwiGLU are one call each instead of a dozen small tensor ops. It rounds to the
  model dtype at the same points as ``TorchOps``, so the paths differ in the order of
  fp32 sums (and attention keeps its probabilities in fp32). Larger batches multiply
  with oneDNN (mid-size ones over packed weights).

Residuals are carried beside the hidden state (``rms_norm(x, w, eps, residual)``
returns the normed input and ``residual + x``), so the add and the norm are one call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_runtime.kernels import cpu as cpu_kernels


class TorchOps:
    native = False

    def prepare(self, model) -> None:
        """Called once the model's weights are loaded (nothing to do on this path)."""

    @staticmethod
    def decode_layers(model, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All layers at once where this path has a fused decode step: (output, residual); else None."""
        return None

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``, except that one bfloat16 row on the CPU takes a matrix-vector product: for a
        single row oneDNN's bf16 GEMM streams the weights at ~9 GB/s here, ``mv`` at ~14 (measured on
        the development machine's 2-core Xeon)."""
        if x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            out = torch.mv(weight, x[0]) if bias is None else torch.addmv(bias, weight, x[0])
            return out.unsqueeze(0)
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual, (norm(x), x)."""
        residual = x if residual is None else residual + x
        h = residual.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), residual

    @staticmethod
    def rope_inputs(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        """What ``rope`` needs for this step, from the fp32 tables: cos/sin rows in the model dtype."""
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def rope(qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int, rope_inputs):
        """Split a fused qkv into [T, heads, head_dim] q, k, v with q and k rotated."""
        cos, sin = rope_inputs
        q, k, v = split_heads(qkv, sizes, head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def split_heads(qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int) -> list[torch.Tensor]:
    """Views of a fused [T, q + k + v] row block as [T, heads, head_dim] q, k and v."""
    return [t.view(t.shape[0], -1, head_dim) for t in qkv.split(sizes, dim=-1)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class CpuKernelOps(TorchOps):
    native = True

    def __init__(self) -> None:
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # data_ptr -> (weight, packed copy)

    @staticmethod
    def decode_layers(model, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode-only step of at most MAX_ROWS tokens: each layer is one kernel call (``decode_layer``)."""
        group = meta.kernel_decodes_only() if hasattr(meta, "kernel_decodes_only") else None
        if group is None or x.shape[0] > cpu_kernels.MAX_ROWS:
            return None
        c = model.config
        step = cpu_kernels.DecodeStep(positions, meta.slot_mapping, group.block_tables, group.context_lens,
                                      group.block_size, model.rotary.cos, model.rotary.sin, c.num_heads,
                                      c.num_kv_heads, c.head_dim, c.head_dim ** -0.5)
        residual = torch.zeros_like(x)
        for layer, kv_cache in zip(model.layers, kv_caches):
            cpu_kernels.decode_layer(layer.kernel_weights(), step, kv_cache, x, residual)
        return x, residual

    def prepare(self, model) -> None:
        """oneDNN-packed copies of a bfloat16 model's matrices, for batches of MAX_ROWS < M <= PACKED_MAX_ROWS:
        oneDNN re-lays plain weights out on every call, and packed ones measured 1.3-1.6x faster there (16-192
        rows; slower for long prefills, which keep the plain weights). The copies double the weights' memory,
        so they are made only while that stays under a quarter of the memory available."""
        weights = [w for w in model.linear_weights() if w.dtype == torch.bfloat16]
        needed = sum(w.numel() * w.element_size() for w in weights)
        if not weights or not _onednn_packing() or needed > available_memory() / 4:
            return
        for w in weights:
            self._packed[w.data_ptr()] = (w, torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= cpu_kernels.MAX_ROWS:
            return cpu_kernels.linear(x.contiguous(), weight, bias)
        if rows <= PACKED_MAX_ROWS:
            source, packed = self._packed.get(weight.data_ptr(), (None, None))
            if source is weight:  # the very tensor it was packed from, not a later one at the same address
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        return cpu_kernels.rms_norm(x, weight, eps, residual), (x if residual is None else residual)

    @staticmethod
    def rope_inputs(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        return positions.contiguous(), cos, sin

    @staticmethod
    def rope(qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int, rope_inputs):
        q_size, kv_size, _ = sizes
        qkv = qkv.contiguous()
        # q's heads and k's heads are adjacent in each row: one in-place pass rotates both.
        cpu_kernels.rope_(qkv, (q_size + kv_size) // head_dim, head_dim, *rope_inputs)
        return split_heads(qkv, sizes, head_dim)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_mul(gate_up.contiguous())


PACKED_MAX_ROWS = 192  # measured crossover with plain-weight GEMM: ~256 rows (SmolLM2's shapes)
PACK_BATCH_HINT = 64


def _onednn_packing() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._reorder_linear_weight)
    except (AttributeError, RuntimeError):  # a torch build without oneDNN's packed linear
        return False


def available_memory() -> int:
    """Bytes the kernel reports available (MemAvailable); 0 where unknown, which turns packing off."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


def select_ops(device: torch.device, dtype: torch.dtype, enforce_eager: bool = False) -> TorchOps:
    """The CPU kernels on the CPU for float32/bfloat16 unless ``enforce_eager`` or unavailable; else PyTorch."""
    if enforce_eager or device.type != "cpu" or dtype not in cpu_kernels.DTYPES or not cpu_kernels.available():
        return TorchOps()
    return CpuKernelOps()
