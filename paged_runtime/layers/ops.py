"""The arithmetic under the layers, as one op set chosen once per model (``select_ops``).

- ``TorchOps``: plain PyTorch with Hugging Face's numerics step for step (RMSNorm in
  fp32, rotate-half RoPE, SwiGLU; Gemma's (1 + w) RMSNorm and GeGLU); every device;
  the oracle for the other set.
- ``CpuKernelOps``: the ``paged_runtime::cpu_*`` ops (``kernels/cpu.py``). A decode
  step's few rows stream each weight matrix once; norm, RoPE and SwiGLU are one call
  each instead of a dozen small tensor ops (a decode step of at most ``max_rows()`` rows, of any number
  where every matrix is GGUF blocks, runs all the decoder layers as one call instead:
  ``worker/cpu_decode_plan.py``). It rounds to the model
  dtype at the same points as ``TorchOps``, so the sets differ in the order of fp32
  sums (and attention keeps its probabilities in fp32). Larger batches multiply with
  oneDNN (mid-size ones over packed weights). Partial rotary (tables narrower than a
  head) takes ``TorchOps``' RoPE: the kernel rotates whole heads.
- ``TritonOps``: CUDA's set (and the CPU's under ``TRITON_INTERPRET=1`` when the engine's
  attention backend is forced to ``triton``): Llama's residual add + RMSNorm, RoPE and
  SiLU-and-mul as one Triton launch each (``paged_runtime::triton_*``, ``kernels/fused.py``),
  rounding where ``TorchOps`` rounds; the rest (products, Gemma's norm and GeGLU, MoE) is
  ``TorchOps``'.

Residuals are carried beside the hidden state (``rms_norm(x, w, eps, residual)``
returns the normed input and ``residual + x``), so the add and the norm are one call.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from paged_runtime.kernels import cpu as cpu_kernels
from paged_runtime.kernels import triton_ops

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
        """Split a fused qkv into [T, heads, head_dim] q, k, v with q and k rotated (their first
        cos.shape[-1] dims: partial rotary passes the rest through)."""
        cos, sin = rope_inputs
        q, k, v = split_heads(qkv, sizes, head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                   slices: tuple[int, ...]) -> None:
        """LoRA's per-row delta, added to ``y`` [T, out] in place (punica's shrink, then expand by part): row t
        of adapter slot s = ``row_slots[t]`` (-1: none) gets ``B_s (A_s x_t)``. ``a`` [S, N*R, in] holds each
        slot's A of the layer's N parts stacked by rank rows (part i's at rows i*R ..), ``b`` [S, out, R] its B
        (scaling folded in), ``slices`` the N parts' output widths: part i's outputs read part i's R ranks only.
        Ranks below R are zero-padded, so they add exact zeros. Rows are grouped by slot: one product pair per
        adapter in the step, in the model dtype (rounded as ``F.linear`` rounds), then one add per row."""
        rank = b.shape[-1]
        slots = row_slots.tolist()
        for slot in sorted(set(slots) - {-1}):
            rows = torch.tensor([t for t, s in enumerate(slots) if s == slot], device=x.device)
            shrunk = F.linear(x.index_select(0, rows), a[slot])
            parts, start = [], 0
            for i, width in enumerate(slices):
                parts.append(F.linear(shrunk[:, i * rank:(i + 1) * rank], b[slot, start:start + width]))
                start += width
            y.index_add_(0, rows, torch.cat(parts, dim=1))

    # Gemma's arithmetic. CpuKernelOps inherits these as they are (no kernel of its own for them).
    @staticmethod
    def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``rms_norm`` with Gemma's weight: times ``1 + weight``, in fp32, rounded once at the end (Llama
        rounds before its multiply)."""
        residual = x if residual is None else residual + x
        h = residual.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (1.0 + weight.float())).to(x.dtype), residual

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU: gelu(gate) (tanh approximation) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
        """Each token's sum over its k experts of weight * down(silu(gate(x)) * up(x)), with ``ids`` / ``weights``
        [T, k], ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I].

        The T * k routes are sorted by expert (one stable argsort) so each expert multiplies its rows as one
        product (``grouped_linear``). Each weighted output is rounded to x's dtype and the k of a token are
        added in ascending expert order, starting from the lowest: Hugging Face's order (its loop over experts
        index_adds into zeros), so bfloat16 rounds as it does too."""
        num_tokens, top_k = ids.shape
        ids, slot = ids.sort(dim=1)  # a token's experts ascending: the order its outputs are summed in
        weights = weights.gather(1, slot)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        ends = torch.searchsorted(flat[order], torch.arange(w13.shape[0], device=ids.device), right=True)
        h = self.grouped_linear(x[order // top_k], w13, ends)
        y = self.grouped_linear(self.silu_mul(h), w2, ends)
        routed = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order
        routed = (routed * weights.reshape(-1, 1)).to(x.dtype).view(num_tokens, top_k, -1)
        out = routed[:, 0]
        for k in range(1, top_k):
            out = out + routed[:, k]
        return out

    def grouped_linear(self, rows: torch.Tensor, stacked: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert (group e ends before row ``ends[e]``) times their expert's matrix
        (``stacked[e]``, [N, K]). CUDA (compute capability 8.0+): one ``grouped_mm``, which reads the group sizes
        on the device (no host sync, so CUDA graphs can capture it). Elsewhere: one ``linear`` per expert that
        has rows (OLMoE-1B-7B's layer, 32 tokens, one thread of the 2-core development machine: 1.3-1.6x faster
        than a loop over tokens; small-row GEMMs are far from the weight-streaming floor there)."""
        if _grouped_mm_runs_on(rows.device):
            return F.grouped_mm(rows, stacked.transpose(1, 2), offs=ends.to(torch.int32))
        out = rows.new_empty(rows.shape[0], stacked.shape[1])
        start = 0
        for expert, end in enumerate(ends.tolist()):
            if end > start:
                out[start:end] = self.linear(rows[start:end], stacked[expert])
            start = end
        return out


def _grouped_mm_runs_on(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(F, "grouped_mm")
            and torch.cuda.get_device_capability(device) >= (8, 0))


def split_heads(qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int) -> list[torch.Tensor]:
    """Views of a fused [T, q + k + v] row block as [T, heads, head_dim] q, k and v."""
    return [t.view(t.shape[0], -1, head_dim) for t in qkv.split(sizes, dim=-1)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over x's first cos.shape[-1] dims (all of them unless the rotary is partial)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot = x[..., :dim]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, x[..., dim:]), dim=-1)


def rope_in_place(rotate_, qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int, rope_inputs):
    """q, k, v of a fused qkv, q and k rotated in place by a kernel ``rotate_(qkv, num_heads, head_dim,
    positions, cos, sin)``: q's heads and k's heads are adjacent in each row, so one pass rotates both. Partial
    rotary (tables narrower than a head) takes ``TorchOps``' RoPE: the kernels rotate whole heads."""
    positions, cos, sin = rope_inputs
    if cos.shape[-1] != head_dim:
        return TorchOps.rope(qkv, sizes, head_dim, TorchOps.rope_inputs(cos, sin, positions, qkv.dtype))
    q_size, kv_size, _ = sizes
    qkv = qkv.contiguous()
    rotate_(qkv, (q_size + kv_size) // head_dim, head_dim, positions, cos, sin)
    return split_heads(qkv, sizes, head_dim)


PACKED_MAX_ROWS = 192  # measured crossover with plain-weight GEMM: ~256 rows (SmolLM2's shapes)
PACK_BATCH_HINT = 64
# cpu_lora_delta against TorchOps' per-adapter GEMMs, a SmolLM2 layer's four deltas (rank 16, 2 cores, bfloat16):
# 9x faster at 32 rows of 4 adapters, 20x with 16; even at 256 rows of one adapter; oneDNN's GEMMs 1.5x faster at
# 1024 (float32: the kernel still 1.3x faster there)
LORA_KERNEL_MAX_ROWS = 256


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
        return rope_in_place(cpu_kernels.cpu_rope_, qkv, sizes, head_dim, rope_inputs)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.cpu_silu_mul(gate_up.contiguous())

    @staticmethod
    def lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                   slices: tuple[int, ...]) -> None:
        """``TorchOps.lora_delta`` as one ``cpu_lora_delta`` call (rows grouped by slot in C: no tensor ops per
        adapter), with its roundings, for up to ``LORA_KERNEL_MAX_ROWS`` rows; longer prefill chunks, and a y
        the kernel cannot write in place (strided, or not [T, out]), take TorchOps'."""
        if x.shape[0] <= LORA_KERNEL_MAX_ROWS and y.dim() == 2 and y.is_contiguous() and x.dim() == 2:
            cpu_kernels.cpu_lora_delta(y, x.contiguous(), a, b, row_slots.contiguous(), slices)
        else:
            TorchOps.lora_delta(y, x, a, b, row_slots, slices)


class TritonOps(TorchOps):
    """Fewer launches per decoder layer. The ops a Llama decoder layer dispatches in a one-row decode step
    (views and allocations left out; counted with a TorchDispatchMode on the CPU, the tiny Llama, triton
    attention; each is about one CUDA kernel):

    - TorchOps, 36: per norm (x2) add, to(fp32), pow, mean, add eps, rsqrt, mul, to(dtype), mul by weight (9);
      qkv linear; RoPE of q, then of k: mul, neg, cat, mul, add (10); store_kv; attention; o linear;
      gate_up linear; silu, mul; down linear. (In fp32 the four casts are no-ops: 32.) Once per step, not
      per layer: cos/sin gathered and cast to the model dtype (4).
    - TritonOps, 10: add+norm, qkv linear, RoPE of q and k (one in-place pass), store_kv, attention, o linear,
      add+norm, gate_up linear, silu-and-mul, down linear (``tests/kernels/test_fused.py`` asserts this list).
    """
    name = "triton"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``TorchOps.rms_norm``; both results are new tensors (no input is written). Rows ([T, H], rows may
        be strided: OLMoE's q/k slices) take the kernel; anything else TorchOps."""
        if x.dim() != 2 or x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
            return TorchOps.rms_norm(x, weight, eps, residual)
        if residual is None:
            return triton_ops.rms_norm(x, weight, eps), x
        return tuple(triton_ops.add_rms_norm(x, residual, weight, eps))

    @staticmethod
    def rope_inputs(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        """The positions and the fp32 tables: the kernel reads the rows itself."""
        return positions.contiguous(), cos, sin

    @staticmethod
    def rope(qkv: torch.Tensor, sizes: tuple[int, int, int], head_dim: int, rope_inputs):
        """As ``TorchOps.rope``, rotating qkv's q and k heads in place (one launch for both)."""
        return rope_in_place(triton_ops.rope_, qkv, sizes, head_dim, rope_inputs)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return triton_ops.silu_mul(gate_up.contiguous())

    @staticmethod
    def lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                   slices: tuple[int, ...]) -> None:
        """As ``TorchOps.lora_delta``, as two launches (shrink, expand) that read ``row_slots`` on the device: no
        host sync, so a CUDA graph captures them with the slot table as an input."""
        triton_ops.lora_delta(y, x.contiguous(), a, b, row_slots, list(slices))


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


def select_ops(device: torch.device, dtype: torch.dtype, use_kernels: bool | None, cache_dir,
               triton: bool = False, isa_name: str | None = None) -> TorchOps:
    """The one place that picks the arithmetic: the Triton kernels with ``triton`` (the engine's attention
    backend is triton, on CUDA by default, on the CPU only forced, under the interpreter, for tests; and not
    enforce_eager); the compiled CPU kernels on the CPU for
    float32/bfloat16 when ``use_kernels`` is True, or None (auto) and the CPU has their vector paths, and they
    build (for ``isa_name``: ``kernels/cpu.load``'s); else PyTorch."""
    if triton:
        return TritonOps()
    if use_kernels is False or device.type != "cpu" or dtype not in cpu_kernels.DTYPES:
        return TorchOps()
    if use_kernels is None and not cpu_kernels.has_vector_paths(isa_name):
        logger.info("the CPU kernels would run scalar loops here (no AVX-512 or AVX2, or cpu_isa scalar), where "
                    "they lose to PyTorch: using PyTorch ops")
        return TorchOps()
    return CpuKernelOps() if cpu_kernels.load(cache_dir, isa_name) else TorchOps()
