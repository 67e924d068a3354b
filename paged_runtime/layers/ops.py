"""The arithmetic under the layers, as one op set chosen once per model (``select_ops``).

- ``TorchOps``: plain PyTorch with Hugging Face's numerics step for step (RMSNorm in
  fp32, rotate-half RoPE, SwiGLU); every device; the oracle for the other set.
- ``CpuKernelOps``: the ``paged_runtime::cpu_*`` ops (``kernels/cpu.py``). A decode
  step's few rows stream each weight matrix once; norm, RoPE and SwiGLU are one call
  each instead of a dozen small tensor ops; a decode-only step of at most
  ``max_rows()`` rows runs each Llama decoder layer as one op. It rounds to the model
  dtype at the same points as ``TorchOps``, so the sets differ in the order of fp32
  sums (and attention keeps its probabilities in fp32). Larger batches multiply with
  oneDNN (mid-size ones over packed weights).

Residuals are carried beside the hidden state (``rms_norm(x, w, eps, residual)``
returns the normed input and ``residual + x``), so the add and the norm are one call.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from paged_runtime.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)


class TorchOps:
    name = "torch"

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A copy of a loaded weight laid out for faster products, or None (nothing to gain here)."""
        return None

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
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

    def fused_decoder_layer(self, meta) -> bool:
        """Whether this step runs each decoder layer as one op (``decoder_layer``); never on this set."""
        return False


def split_heads(qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int) -> list[torch.Tensor]:
    """Views of a fused [T, q + k + v] row block as [T, heads, head_dim] q, k and v."""
    return [t.view(t.shape[0], -1, head_dim) for t in qkv.split(sizes, dim=-1)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


PACKED_MAX_ROWS = 192  # measured crossover with plain-weight GEMM: ~256 rows (SmolLM2's shapes)
PACK_BATCH_HINT = 64


class CpuKernelOps(TorchOps):
    name = "cpu-kernels"

    def __init__(self, pack_budget: int | None = None) -> None:
        """``pack_budget``: bytes of packed weight copies allowed (default: a quarter of MemAvailable)."""
        self.max_rows = cpu_kernels.max_rows()
        self.pack_budget = available_memory() // 4 if pack_budget is None else pack_budget

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """oneDNN-packed copy of a bfloat16 matrix, for batches of max_rows < M <= PACKED_MAX_ROWS: oneDNN
        re-lays plain weights out on every call, and packed ones measured 1.3-1.6x faster there (16-192 rows;
        slower for long prefills, which keep the plain weights). Copies double the weights' memory, so they
        are made only while they fit in ``pack_budget``."""
        size = weight.numel() * weight.element_size()
        if weight.dtype != torch.bfloat16 or size > self.pack_budget or not _onednn_packing():
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        except RuntimeError:  # oneDNN's bf16 packing needs AVX-512 (or AVX-NE-CONVERT): none on this CPU
            self.pack_budget = 0
            return None
        self.pack_budget -= size
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.max_rows:
            return cpu_kernels.cpu_linear(x.contiguous(), weight, bias)
        if packed is not None and rows <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
        return F.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        return cpu_kernels.cpu_rms_norm(x, residual, weight, eps), (x if residual is None else residual)

    @staticmethod
    def rope_inputs(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        return positions.contiguous(), cos, sin

    @staticmethod
    def rope(qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int, rope_inputs):
        q_size, kv_size, _ = sizes
        qkv = qkv.contiguous()
        # q's heads and k's heads are adjacent in each row: one in-place pass rotates both.
        cpu_kernels.cpu_rope_(qkv, (q_size + kv_size) // head_dim, head_dim, *rope_inputs)
        return split_heads(qkv, sizes, head_dim)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.cpu_silu_mul(gate_up.contiguous())

    def fused_decoder_layer(self, meta) -> bool:
        """A step of one-token query rows only (decodes and verification rows), at most max_rows of them,
        with the kernel backend's metadata: each decoder layer is one ``cpu_decode_layer`` op."""
        return meta.rows_only and meta.num_tokens <= self.max_rows

    @staticmethod
    def decoder_layer(x: torch.Tensor, residual: torch.Tensor, kv_cache: torch.Tensor,
                      weights: list[torch.Tensor | None], eps: float, meta, rope_tables, heads: int,
                      scale: float, window: int | None = None) -> None:
        """One Llama decoder layer over the step's rows, in place (x: input -> output; residual advanced);
        its attention over each row's last ``window`` tokens when given (Mistral's sliding window)."""
        cos, sin = rope_tables
        rows = meta.decode_rows
        cpu_kernels.cpu_decode_layer(x, residual, kv_cache, weights, meta.positions, meta.slot_mapping,
                                     rows.block_tables, rows.context_lens, cos, sin, meta.block_size, heads,
                                     scale, eps, window or 0)


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


def select_ops(device: torch.device, dtype: torch.dtype, use_kernels: bool | None, cache_dir) -> TorchOps:
    """The one place that picks the arithmetic: the compiled CPU kernels on the CPU for float32/bfloat16 when
    ``use_kernels`` is True, or None (auto) and the CPU has their vector paths, and they build; else PyTorch."""
    if use_kernels is False or device.type != "cpu" or dtype not in cpu_kernels.DTYPES:
        return TorchOps()
    if use_kernels is None and not cpu_kernels.has_vector_paths():
        logger.info("this CPU lacks AVX-512, where the CPU kernels lose to PyTorch: using PyTorch ops")
        return TorchOps()
    return CpuKernelOps() if cpu_kernels.load(str(cache_dir)) else TorchOps()
