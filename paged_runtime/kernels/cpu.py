"""CPU decode kernels: ``cpu_ops.c``, compiled on first use and called through ctypes.

The library is built with the system C compiler (``-O3 -march=native -fopenmp``,
about a second) into the runtime's cache folder (``$PAGED_RUNTIME_CACHE``, default
``~/.cache/paged_runtime``, as for converted models), named by a hash of the source, the compiler and the CPU's feature flags, so a
later start loads it at once and a changed source or machine rebuilds it. No
compiler, or a failed build, leaves the PyTorch path in charge (logged once).
``PAGED_RUNTIME_CPU_KERNELS=0`` turns the kernels off; so does ``enforce_eager``.

Every wrapper takes contiguous CPU tensors of one dtype (float32 or bfloat16)
and writes into tensors it allocates; see the C file for each kernel's numerics.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
DISABLE_ENV = "PAGED_RUNTIME_CPU_KERNELS"
MAX_ROWS = 16  # linear() and decode_layer(): rows per call (MAX_ROWS in the C file); more use oneDNN
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "pr_linear": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int], _int),
    "pr_rms_norm": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int], None),
    "pr_rope": ([_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int], None),
    "pr_silu_mul": ([_ptr, _ptr, _i64, _i64, _int], None),
    "pr_paged_decode_attention": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32, _ptr,
                                   _int], _int),
    "pr_decode_layer": ([_ptr, _ptr, _ptr, _ptr, _ptr, _int], _int),
}


class _Paged(ctypes.Structure):
    _fields_ = [("block_tables", _ptr), ("context_lens", _ptr), ("table_stride", _i64), ("block_size", _i64),
                ("heads", _i64), ("kv_heads", _i64), ("dim", _i64), ("scale", _f32)]


class LayerWeights(ctypes.Structure):
    """A decoder layer's weights for ``decode_layer`` (pointers: build after the weights are in place)."""
    _fields_ = [("input_norm", _ptr), ("qkv", _ptr), ("qkv_bias", _ptr), ("o", _ptr), ("post_norm", _ptr),
                ("gate_up", _ptr), ("down", _ptr), ("hidden", _i64), ("intermediate", _i64), ("eps", _f32)]

    @classmethod
    def of(cls, input_norm: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None, o: torch.Tensor,
           post_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, eps: float) -> LayerWeights:
        tensors = (input_norm, qkv, qkv_bias, o, post_norm, gate_up, down)
        if any(t is not None and not t.is_contiguous() for t in tensors):
            raise ValueError("decode_layer needs contiguous weights")
        return cls(*(_p(t) for t in tensors), o.shape[0], down.shape[1], eps)


class _DecodeStep(ctypes.Structure):
    _fields_ = [("rows", _i64), ("positions", _ptr), ("slots", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("paged", _Paged)]


class DecodeStep:
    """One decode step's inputs to ``decode_layer``, shared by every layer; holds the tensors it points at."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int, head_dim: int, scale: float) -> None:
        index = [t.to(torch.int64).contiguous() for t in (positions, slots, block_tables, context_lens)]
        self._tensors = index + [cos.float().contiguous(), sin.float().contiguous()]
        positions, slots, block_tables, context_lens, cos, sin = self._tensors
        paged = _Paged(_p(block_tables), _p(context_lens), block_tables.stride(0), block_size, heads, kv_heads,
                       head_dim, scale)
        self.struct = _DecodeStep(positions.shape[0], _p(positions), _p(slots), _p(cos), _p(sin), paged)


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *_FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    from paged_runtime.models.default_model import cache_dir
    target = cache_dir() / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent starts never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they are turned off or cannot be built."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: the CPU decode kernels are off (PyTorch path)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("building the CPU decode kernels failed, using the PyTorch path: %s", detail)
        return None
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def available() -> bool:
    return library() is not None


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight[N, K].T (+ bias), weights streamed once for all M rows."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if library().pr_linear(_p(x), _p(weight), _p(bias), _p(out), m, n, k, DTYPES[x.dtype]):
        raise RuntimeError(f"pr_linear failed for a {m}x{k} input")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x, or of ``residual += x`` (updated in place) when residual is given."""
    out = torch.empty_like(x)
    library().pr_rms_norm(_p(x), _p(residual), _p(weight), _p(out), x.shape[0], x.shape[1], eps, DTYPES[x.dtype])
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate the first ``heads`` heads of every row of qkv in place (the q heads, then the k heads)."""
    library().pr_rope(_p(qkv), qkv.stride(0), _p(positions), _p(cos), _p(sin), qkv.shape[0], heads, head_dim,
                      DTYPES[qkv.dtype])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    m, width = gate_up.shape
    out = torch.empty(m, width // 2, dtype=gate_up.dtype)
    library().pr_silu_mul(_p(gate_up), _p(out), m, width // 2, DTYPES[gate_up.dtype])
    return out


def decode_layer(weights: LayerWeights, step: DecodeStep, kv_cache: torch.Tensor, x: torch.Tensor,
                 residual: torch.Tensor) -> None:
    """A whole decoder layer for up to MAX_ROWS decode tokens: stores their K/V, replaces x (the layer's
    input) by its output and advances residual (zeros before the first layer), in one call."""
    rc = library().pr_decode_layer(ctypes.byref(weights), ctypes.byref(step.struct), _p(kv_cache), _p(x),
                                   _p(residual), DTYPES[x.dtype])
    if rc:
        raise RuntimeError(f"pr_decode_layer failed ({rc}) for {x.shape[0]} rows")


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """One query token per row of q ([B, H, D], rows may be strided) over its paged context."""
    b, heads, dim = q.shape
    if q.stride(1) != dim or q.stride(2) != 1:
        raise ValueError("q's heads must be contiguous within a row")
    out = torch.empty(b, heads, dim, dtype=q.dtype)
    rc = library().pr_paged_decode_attention(
        _p(q), q.stride(0), _p(kv_cache), _p(block_tables), block_tables.stride(0), _p(context_lens), b, heads,
        kv_cache.shape[2], dim, block_size, scale, _p(out), DTYPES[q.dtype])
    if rc:
        raise MemoryError("pr_paged_decode_attention could not allocate its score buffers")
    return out
