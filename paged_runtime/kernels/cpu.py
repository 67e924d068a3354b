"""CPU decode kernels: ``cpu_ops.c``, compiled on first use, exposed as ``paged_runtime::cpu_*`` ops.

The library is built with the system C compiler (``-O3 -march=native -fopenmp``;
38 s on a 2-core Zen 3 with gcc 12, 48 s for the AVX-512 build) into ``<cache_dir>/kernels/``,
named by a hash of the source, the compiler, its flags and the CPU's feature flags, so a later
start loads it at once and a changed source or machine rebuilds it. ``EngineConfig.cpu_isa`` (``--cpu-isa``,
``$PAGED_RUNTIME_CPU_ISA``) builds it for less than this CPU has (``ISAS``: ``avx2`` on an AVX-512 CPU
runs the AVX2 paths, as on a CPU without AVX-512; ``scalar`` the plain loops), like PyTorch's
``ATEN_CPU_CAPABILITY``: tests run every variant the CPU can, and a user can rule out a path. The library
is process-wide: one ISA per process, and a load asking for another raises. ``kernel_variants()`` says
which path each kernel family was compiled to (the C file's ``pr_kernel_variants``).
``load(cache_dir, isa_name)`` returns False, with one warning, where anything fails (no compiler, a failed
build, a library without the expected symbols or with other struct sizes, an OSError): the PyTorch path runs.

A shared library runs as this process, so the cache is trusted only as far as no
one else could have written it. The folder is created 0700; a build goes to a
temporary file in it, made 0700 and renamed into place. A folder or a library is
used only if it is owned by this user and not writable by group or others,
checked with fstat on the opened file (open by descriptor, dlopen through
``/proc/self/fd``, so a swap between the check and the load is impossible). Where
the cache fails that check (or cannot be created: a read-only home), the library
is built into a fresh private temporary folder instead, with a warning: every
start then compiles again, but runs the same kernels, and never
writes to or reads from the suspicious folder.

ctypes is the loader; the ops registered here are the boundary the model calls
(``torch.ops.paged_runtime.cpu_linear`` and friends): the profiler names them and
``torch.compile`` traces around them (each has a fake implementation). The ops are
``torch.library.Library`` definitions rather than ``custom_op``: the latter costs
~22 us a call here, the former ~4 (measured), and a decode step makes 30 of them.

Every op takes contiguous CPU tensors of one dtype (float32 or bfloat16), index
tensors int64; see the C file for each kernel's numerics. The GGUF ops
(``cpu_gguf_linear``, ``cpu_gguf_dequantize``) also take a weight as its GGUF bytes
(uint8 [N, row bytes], ggml type ids from ``gguf_types``); their vector paths need
AVX2, not AVX-512. The C file's constants
and struct sizes are read from the library (``pr_abi``), never restated here.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import logging
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from paged_runtime.kernels import gguf_types

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The element kind of a cache in another dtype than the model's (cpu_ops.c's KV_FP8 / KV_INT8 / KV_BF16, beside
# KV_MODEL = 0: the model's own): 8-bit, or bfloat16 under float32 activations (kernels/kv_quant.py).
KV_DTYPES = {torch.float8_e4m3fn: 1, torch.int8: 2, torch.bfloat16: 3}
SCALED_KV = (torch.float8_e4m3fn, torch.int8)  # the caches read with their kv_scale
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
ISA_ENV = "PAGED_RUNTIME_CPU_ISA"


class Isa(NamedTuple):
    flags: list[str]  # the compiler's
    needs: tuple[str, ...]  # the /proc/cpuinfo flags a CPU must have to run the build


_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_V3 = ("avx2", "fma", "f16c")
# The instruction sets the library can be built for, best first (config.CPU_ISAS names them, in this order).
# "auto" is whatever this CPU has; the x86-64 levels are the psABI's (v4: AVX-512 F/BW/CD/DQ/VL; v3: AVX2,
# FMA, F16C); the VNNI ones add vpdpbusd, the int8 dot product of the GGUF x8 kernel; amx (Sapphire Rapids and
# later) adds AVX512-BF16 and the AMX-INT8 tile products the x8 kernel takes batches of 16 rows and more through.
ISAS = {"auto": Isa(["-march=native"], ()),
        "amx": Isa(["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8"],
                   (*_V4, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")),
        "avx512_vnni": Isa(["-march=x86-64-v4", "-mavx512vnni"], (*_V4, "avx512_vnni")),
        "avx512": Isa(["-march=x86-64-v4"], _V4),
        "avx_vnni": Isa(["-march=x86-64-v3", "-mavxvnni"], (*_V3, "avx_vnni")),
        "avx2": Isa(["-march=x86-64-v3"], _V3),
        "scalar": Isa(["-march=x86-64"], ())}

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "pr_abi": ([_int], _i64),
    "pr_kernel_variants": ([], ctypes.c_char_p),
    "pr_linear": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int], _int),
    "pr_rms_norm": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int], None),
    "pr_rope": ([_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int], None),
    "pr_silu_mul": ([_ptr, _ptr, _i64, _i64, _int], None),
    "pr_paged_decode_attention": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32,
                                   _f32, _ptr, _int, _int, _ptr], _int),
    "pr_attention_tile_rows": ([_int], None),
    "pr_paged_prompt_attention": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32,
                                   _ptr, _int, _int, _ptr], _int),
    "pr_decode_layers": ([_ptr, _i64, _ptr, _ptr, _ptr, _int], _int),
    "pr_lora_delta": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _int], _int),
    "pr_gguf_linear": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int], _int),
    "pr_gguf_dequantize": ([_ptr, _ptr, _i64, _i64, _int, _int], _int),
    "pr_gguf_force_scalar": ([_int], None),
    "pr_gguf_abi": ([_int], _i64),
    "pr_gguf_pack_x8": ([_ptr, _ptr, _i64, _i64, _int], _int),
    "pr_kv_gather": ([_ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _ptr, _int], None),
}


class _Paged(ctypes.Structure):
    _fields_ = [("block_tables", _ptr), ("context_lens", _ptr), ("table_stride", _i64), ("block_size", _i64),
                ("heads", _i64), ("kv_heads", _i64), ("dim", _i64), ("window", _i64), ("scale", _f32),
                ("softcap", _f32), ("kv_dt", _int), ("kv_scale", _ptr)]


PLAIN = -1  # a decode-stack matrix part in the model dtype (cpu_ops.c's PLAIN); others are GGUF type ids
MAX_PARTS = 3  # parts of one fused-layer matrix (q | k | v); the struct sizes below are checked against the C


class _Part(ctypes.Structure):
    _fields_ = [("data", _ptr), ("rows", _i64), ("type", _i64)]


class _LoRA(ctypes.Structure):
    _fields_ = [("a", _ptr), ("b", _ptr), ("slots", _i64), ("rank", _i64), ("parts", _i64),
                ("width", _i64 * MAX_PARTS)]


class _Matrix(ctypes.Structure):
    _fields_ = [("part", _Part * MAX_PARTS), ("parts", _i64), ("lora", _LoRA)]


class _Norm(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("kind", _i64)]


NORMS = ("attn_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")  # LayerWeights' order
MATRICES = ("qkv", "o", "gate_up", "down")


class _LayerWeights(ctypes.Structure):
    _fields_ = ([(name, _Norm) for name in NORMS] + [("qkv_bias", _ptr)] + [(name, _Matrix) for name in MATRICES]
                + [("hidden", _i64), ("intermediate", _i64), ("activation", _i64), ("eps", _f32)])


class _DecodeStep(ctypes.Structure):
    _fields_ = [("rows", _i64), ("positions", _ptr), ("slots", _ptr), ("lora_slots", _ptr), ("paged", _Paged)]


class _StackLayer(ctypes.Structure):
    _fields_ = [("weights", ctypes.POINTER(_LayerWeights)), ("kv_cache", _ptr), ("kv_scale", _ptr), ("window", _i64),
                ("scale", _f32), ("softcap", _f32), ("cos", _ptr), ("sin", _ptr), ("rot", _i64)]


_ABI_SIZES = {1: _LayerWeights, 2: _DecodeStep, 3: _Paged, 4: _StackLayer, 7: _LoRA}  # pr_abi(i): sizeof these


class _Loaded:
    """The one library this process loaded (a shared library is process-wide by nature)."""
    lib: ctypes.CDLL | None = None
    isa: str | None = None  # the ISAS name lib was built for (set with lib)
    max_rows: int = 0
    gguf_x8: int = 0
    kinds: dict[str, int] = {}


# ---- build and load --------------------------------------------------------------------------------
def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def has_vector_paths(isa_name: str | None = None) -> bool:
    """Whether the kernels built for ``isa_name`` (``isa``'s choice) run vector code on this CPU: AVX-512F, or
    AVX2 with FMA and F16C (half the width, the same loops). Elsewhere they fall back to scalar loops, which
    measured 2.1x slower than the PyTorch path at batch 1 in bfloat16 (80 vs 38 ms a step, SmolLM2 on a 2-core
    AMD EPYC, ``benchmarks/cpu_decode.py``)."""
    flags = set(_cpu_flags().split())
    return isa(isa_name) != "scalar" and ("avx512f" in flags or set(_V3) <= flags)


def isa(name: str | None = None) -> str:
    """The instruction set to build the kernels for: ``name`` (``EngineConfig.cpu_isa``), else
    ``$PAGED_RUNTIME_CPU_ISA``, else "auto"; ValueError for a name not in ``ISAS`` or one this CPU lacks."""
    name = name or os.environ.get(ISA_ENV) or "auto"
    if name not in ISAS:
        raise ValueError(f"cpu_isa (${ISA_ENV}) must be one of {', '.join(ISAS)}; got {name!r}")
    if not cpu_has(name):
        raise ValueError(f"cpu_isa {name}: this CPU lacks {', '.join(_lacking(name))}")
    return name


def _lacking(name: str) -> list[str]:
    return sorted(set(ISAS[name].needs) - set(_cpu_flags().split()))


def cpu_has(name: str) -> bool:
    """Whether this CPU can run the kernels built for ISA ``name``."""
    return not _lacking(name)


def _build_flags(isa_name: str) -> list[str]:
    return [*ISAS[isa_name].flags, *_FLAGS]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


KERNELS_FOLDER = "kernels"  # the cache's private subfolder for compiled libraries


class _Untrusted(Exception):
    """A cache folder or file this process must not use: another user could have written it (or, for the
    folder, it cannot be made)."""


def library_path(cache_dir: str | Path, compiler: str | None = None, isa_name: str | None = None) -> Path:
    """Where ``load(cache_dir, isa_name)`` keeps the library for this source, compiler, build flags and CPU."""
    compiler = compiler or _compiler() or ""
    text = "\0".join([SOURCE.read_text(), compiler, *_build_flags(isa(isa_name)), _cpu_flags()])
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Path(cache_dir) / KERNELS_FOLDER / f"cpu_ops-{key}.so"


def _check_private(st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise _Untrusted(f"{what} is owned by uid {st.st_uid}, not this process's {os.geteuid()}")
    if st.st_mode & 0o022:
        raise _Untrusted(f"{what} is writable by group or others (mode {oct(stat.S_IMODE(st.st_mode))})")


def _fd_path(fd: int, path: Path) -> str:
    """A name for what ``fd`` holds open, so the compiler and dlopen use the very folder or file that was
    checked, not whatever the path names by then; the path itself where there is no /proc."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)


def _open_private_folder(folder: Path) -> int:
    """An fd of ``folder``, created 0700 if missing; raises _Untrusted unless it is this user's and private."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)  # the umask can only take bits away
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except NotADirectoryError:  # also a symlink, with O_NOFOLLOW | O_DIRECTORY
        raise _Untrusted(f"the kernel cache folder {folder} is not a directory") from None
    except OSError as e:  # a read-only or foreign home, say
        raise _Untrusted(f"the kernel cache folder {folder} cannot be used ({e})") from None
    try:
        _check_private(os.fstat(fd), f"the kernel cache folder {folder}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_private_file(dir_fd: int, name: str) -> int | None:
    """An fd of the library ``name`` in the open folder, checked after opening; None where there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink
            raise _Untrusted(f"the cached kernel library {name} is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted(f"the cached kernel library {name} is not a regular file")
        _check_private(st, f"the cached kernel library {name}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _build(compiler: str, dir_fd: int, folder: Path, name: str, isa_name: str) -> None:
    """Compile into a temporary file in the folder, make it 0700 and rename it into place: a concurrent start
    never sees a half-written library, and the linker's umask-given mode never lasts."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        out = f"{_fd_path(dir_fd, folder)}/{tmp}"
        subprocess.run([compiler, *_build_flags(isa_name), str(SOURCE), "-o", out, "-lm"],
                       check=True, capture_output=True, text=True, timeout=120, pass_fds=(dir_fd,))
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)


def _open_library(compiler: str, folder: Path, isa_name: str) -> ctypes.CDLL:
    """The library for ``isa_name`` from the private ``folder``, built there first if absent; raises _Untrusted
    where the folder or the file there could have been written by someone else."""
    name = library_path("", compiler, isa_name).name
    dir_fd = _open_private_folder(folder)
    try:
        fd = _open_private_file(dir_fd, name)
        if fd is None:
            _build(compiler, dir_fd, folder, name, isa_name)
            fd = _open_private_file(dir_fd, name)
        # On success fd stays open for the life of the process: the dynamic loader knows the library by its
        # /proc/self/fd name, and a later dlopen of that name must never find a different file under it.
        try:
            return ctypes.CDLL(_fd_path(fd, folder / name))
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dir_fd)


def _open_cached_library(compiler: str, cache_dir: Path, isa_name: str) -> ctypes.CDLL:
    """The library for ``isa_name`` from the cache; where the cache cannot be trusted, one built into a private
    temporary folder instead (a compile at every start, but the same kernels, and the cache is never written)."""
    try:
        return _open_library(compiler, cache_dir / KERNELS_FOLDER, isa_name)
    except _Untrusted as e:
        logger.warning("%s: building the CPU decode kernels into a private temporary folder instead", e)
    with tempfile.TemporaryDirectory(prefix="paged_runtime-kernels-") as private:
        return _open_library(compiler, Path(private), isa_name)


def _bind(lib: ctypes.CDLL) -> None:
    """Give the library's functions their signatures; raises where a symbol is missing or the library's
    structs differ from this file's."""
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    mismatched = [s.__name__ for i, s in _ABI_SIZES.items() if lib.pr_abi(i) != ctypes.sizeof(s)]
    if mismatched:
        raise ImportError(f"the library's structs differ from cpu.py's ({', '.join(mismatched)})")


def load(cache_dir: str | Path, isa_name: str | None = None) -> bool:
    """Build (if needed) and load the kernels for ``isa_name`` (``isa``'s choice: None reads
    ``$PAGED_RUNTIME_CPU_ISA``, else "auto") from ``cache_dir``; False, with one warning, where that fails for
    any reason (no compiler, a failed build, a library that does not load or bind): the PyTorch path runs then.
    A user's mistake is said, never a silent fallback: ValueError for an ISA this CPU lacks, and for one other
    than the ISA this process already loaded (the library is process-wide)."""
    name = isa(isa_name)
    if _Loaded.lib is not None and _Loaded.isa != name:
        raise ValueError(f"the CPU kernels are loaded for cpu_isa {_Loaded.isa} in this process, which cannot "
                         f"load them for {name} as well (one library per process)")
    return _load(str(cache_dir), name)


@functools.cache
def _load(cache_dir: str, isa_name: str) -> bool:
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: the CPU decode kernels are off (PyTorch path)")
        return False
    try:
        lib = _open_cached_library(compiler, Path(cache_dir), isa_name)
        _bind(lib)
    except Exception as e:  # noqa: BLE001 - the kernels are optional: whatever failed, PyTorch runs
        detail = getattr(e, "stderr", "") or e
        logger.warning("the CPU decode kernels did not load, using the PyTorch path: %s", detail)
        return False
    _Loaded.lib, _Loaded.isa, _Loaded.max_rows = lib, isa_name, lib.pr_abi(0)
    logger.info("CPU kernels loaded, built for %s (%s): %s", isa_name, " ".join(ISAS[isa_name].flags),
                " ".join(f"{family}={variant}" for family, variant in kernel_variants().items()))
    return True


def loaded() -> bool:
    """Whether ``load`` succeeded in this process."""
    return _Loaded.lib is not None


def kernel_variants() -> dict[str, str]:
    """Each kernel family of the loaded library and the path it was compiled to (``{"gguf_x8": "avx512_vnni",
    ...}``: the C file's ``pr_kernel_variants``, which the build flags decide)."""
    return dict(pair.split("=", 1) for pair in _lib().pr_kernel_variants().decode().split())


def info() -> dict | None:
    """The loaded kernels as /version and the benchmarks report them: ``{"isa": ISAS name, "variants":
    kernel_variants()}``; None where none are loaded in this process."""
    return None if _Loaded.lib is None else {"isa": _Loaded.isa, "variants": kernel_variants()}


def max_rows() -> int:
    """Most rows ``cpu_linear`` and ``DecodeStack.run`` take in one call (MAX_ROWS in the C file)."""
    return _Loaded.max_rows


def _lib() -> ctypes.CDLL:
    if _Loaded.lib is None:
        raise RuntimeError("the CPU kernels are not loaded (kernels.cpu.load)")
    return _Loaded.lib


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---- the ops -------------------------------------------------------------------------------------
LIB = torch.library.Library("paged_runtime", "FRAGMENT")


def _op(schema: str, fake):
    """Define ``paged_runtime::<schema>`` with the decorated function as its CPU kernel and ``fake`` as its
    meta implementation; returns the op (``torch.ops.paged_runtime.<name>``)."""
    name = schema.split("(", 1)[0]

    def register(impl):
        LIB.define(schema)
        LIB.impl(name, impl, "CPU")
        torch.library.register_fake(f"paged_runtime::{name}", fake, lib=LIB)
        return getattr(torch.ops.paged_runtime, name)
    return register


def _linear_fake(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@_op("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _linear_fake)
def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M <= max_rows(), K] @ weight[N, K].T (+ bias), weights streamed once for all M rows."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if _lib().pr_linear(_p(x), _p(weight), _p(bias), _p(out), m, n, k, DTYPES[x.dtype]):
        raise RuntimeError(f"pr_linear failed for a {m}x{k} input")
    return out


@_op("cpu_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor",
     lambda x, residual, weight, eps: torch.empty_like(x))
def cpu_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x, or of ``residual += x`` (updated in place) when residual is given."""
    out = torch.empty_like(x)
    _lib().pr_rms_norm(_p(x), _p(residual), _p(weight), _p(out), x.shape[0], x.shape[1], eps, DTYPES[x.dtype])
    return out


@_op("cpu_rope_(Tensor(a!) qkv, int heads, int head_dim, Tensor positions, Tensor cos, Tensor sin) -> ()",
     lambda qkv, heads, head_dim, positions, cos, sin: None)
def cpu_rope_(qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
    """Rotate the first ``heads`` heads of every row of qkv in place (the q heads, then the k heads)."""
    _lib().pr_rope(_p(qkv), qkv.stride(0), _p(positions), _p(cos), _p(sin), qkv.shape[0], heads, head_dim,
                   DTYPES[qkv.dtype])


@_op("cpu_silu_mul(Tensor gate_up) -> Tensor",
     lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))
def cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    m, width = gate_up.shape
    out = torch.empty(m, width // 2, dtype=gate_up.dtype)
    _lib().pr_silu_mul(_p(gate_up), _p(out), m, width // 2, DTYPES[gate_up.dtype])
    return out


def _lora_slots(a: torch.Tensor, b: torch.Tensor, slices, dtype: torch.dtype, k: int, n: int) -> _LoRA:
    """A layer's adapter slots (``layers/lora.py``: ``a`` [S, len(slices) * R, k], ``b`` [S, n, R], ``slices``
    the parts' output widths, summing to n) as the C struct, checked: the C code reads them raw."""
    slots, rank = a.shape[0], b.shape[-1]
    if not 1 <= len(slices) <= MAX_PARTS or sum(slices) != n:
        raise ValueError(f"LoRA slices must be 1..{MAX_PARTS} widths summing to {n}, not {list(slices)}")
    if a.shape != (slots, len(slices) * rank, k) or b.shape != (slots, n, rank):
        raise ValueError(f"LoRA slots must be [S, {len(slices)} * R, {k}] and [S, {n}, R], not {list(a.shape)} "
                         f"and {list(b.shape)}")
    if a.dtype != dtype or b.dtype != dtype or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"LoRA slots must be contiguous {dtype} tensors")
    return _LoRA(a.data_ptr(), b.data_ptr(), slots, rank, len(slices), (_i64 * MAX_PARTS)(*slices))


@_op("cpu_lora_delta(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor row_slots, int[] slices) -> ()",
     lambda y, x, a, b, row_slots, slices: None)
def cpu_lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                   slices: list[int]) -> None:
    """``TorchOps.lora_delta`` in one call: y [T, N] += row t's adapter delta, in place, for the rows whose slot
    ``row_slots[t]`` (int64) is not -1, rounded where the reference rounds (see the C file). Rows are grouped by
    slot in C, so each adapter's A and B are read once per step; any T (ValueError for a slot out of range)."""
    (t, k), n = x.shape, y.shape[1]
    if x.dtype not in DTYPES or y.dtype != x.dtype or y.shape[0] != t or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError(f"cpu_lora_delta takes contiguous float32/bfloat16 x and y of {t} rows")
    if row_slots.dtype != torch.int64 or row_slots.shape != (t,) or not row_slots.is_contiguous():
        raise ValueError(f"row_slots must be a contiguous int64 [{t}] tensor")
    lora = _lora_slots(a, b, slices, x.dtype, k, n)
    rc = _lib().pr_lora_delta(_p(y), _p(x), ctypes.byref(lora), _p(row_slots), t, k, DTYPES[x.dtype])
    if rc == -1:
        raise ValueError(f"row_slots names a slot outside [-1, {a.shape[0]})")
    if rc:
        raise MemoryError("pr_lora_delta could not allocate its scratch")


@_op("cpu_paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, "
     "int block_size, float scale, int window=0, float softcap=0., Tensor? kv_scale=None) -> Tensor",
     lambda q, kv_cache, block_tables, context_lens, block_size, scale, window=0, softcap=0., kv_scale=None:
     torch.empty_like(q))
def cpu_paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, block_size: int, scale: float, window: int = 0,
                               softcap: float = 0., kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row of q ([B, H, D], rows may be strided) over its paged context: its last
    ``window`` tokens when window > 0 (the blocks before them are not read), scores soft-capped at
    ``softcap`` when > 0 (``c * tanh(s / c)`` of the scaled score). An 8-bit cache (fp8 / int8) is read
    dequantized with ``kv_scale``, a bfloat16 one under float32 q widened (``kernels.kv_quant``)."""
    b, heads, dim = q.shape
    if q.stride(1) != dim or q.stride(2) != 1:
        raise ValueError("q's heads must be contiguous within a row")
    out = torch.empty(b, heads, dim, dtype=q.dtype)
    rc = _lib().pr_paged_decode_attention(
        _p(q), q.stride(0), _p(kv_cache), _p(block_tables), block_tables.stride(0), _p(context_lens), b, heads,
        kv_cache.shape[2], dim, block_size, window, scale, softcap, _p(out), DTYPES[q.dtype],
        *_kv_args(kv_cache, kv_scale, q.dtype))
    if rc:
        raise MemoryError("pr_paged_decode_attention could not allocate its score buffers")
    return out


@_op("cpu_paged_prompt_attention(Tensor q, Tensor kv_cache, Tensor block_table, int context_len, int block_size, "
     "float scale, int window=0, float softcap=0., Tensor? kv_scale=None) -> Tensor",
     lambda q, kv_cache, block_table, context_len, block_size, scale, window=0, softcap=0., kv_scale=None:
     torch.empty_like(q))
def cpu_paged_prompt_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                               block_size: int, scale: float, window: int = 0, softcap: float = 0.,
                               kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One request's prompt chunk: q ([L, H, D], rows may be strided) holds the queries at positions
    context_len - L .. context_len - 1, each attending causally over the paged context of ``block_table``
    ([max_blocks] int64, contiguous), its keys and values already stored; window, softcap and kv_scale as in
    ``cpu_paged_decode_attention``. Blocked products with an online softmax (flash attention): the long
    chunks' path, SDPA's result within rounding."""
    length, heads, dim = q.shape
    if q.stride(1) != dim or q.stride(2) != 1:
        raise ValueError("q's heads must be contiguous within a row")
    if kv_cache.dim() != 4 or kv_cache.shape[3] != dim or heads % kv_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} cannot read a cache of shape {tuple(kv_cache.shape)}: it needs "
                         "[slots, 2, kv_heads, head_dim] with the query heads a multiple of kv_heads")
    if (not length <= context_len <= block_table.shape[0] * block_size or block_table.dim() != 1
            or block_table.dtype != torch.int64 or not block_table.is_contiguous()):
        raise ValueError(f"a chunk of {length} queries at context {context_len} needs a contiguous int64 table of "
                         f"{-(-context_len // block_size)} blocks or more; got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    out = torch.empty(length, heads, dim, dtype=q.dtype)
    if not length:
        return out
    rc = _lib().pr_paged_prompt_attention(
        _p(q), q.stride(0), _p(kv_cache), _p(block_table), length, context_len, heads, kv_cache.shape[2], dim,
        block_size, window, scale, softcap, _p(out), DTYPES[q.dtype], *_kv_args(kv_cache, kv_scale, q.dtype))
    if rc:
        raise MemoryError("pr_paged_prompt_attention could not allocate its context panels")
    return out


@_op("cpu_kv_gather(Tensor kv_cache, Tensor? kv_scale, Tensor slots, ScalarType dtype) -> Tensor",
     lambda kv_cache, kv_scale, slots, dtype: kv_cache.new_empty((slots.shape[0], *kv_cache.shape[1:]), dtype=dtype))
def cpu_kv_gather(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, slots: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Slots ``slots`` of an 8-bit cache dequantized to ``dtype`` in one pass: ``kv_quant.gather``'s result
    (fp8 with ``kv_scale`` None: the values unscaled)."""
    if kv_cache.dtype not in SCALED_KV:
        raise ValueError(f"cpu_kv_gather reads an 8-bit cache, not {kv_cache.dtype}")
    kv_dt = KV_DTYPES[kv_cache.dtype]
    if kv_dt == 2 and kv_scale is None:
        raise ValueError("an int8 KV cache needs its kv_scale")
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty((slots.shape[0], *kv_cache.shape[1:]), dtype=dtype)
    _lib().pr_kv_gather(_p(kv_cache), _p(kv_scale), _p(slots), slots.shape[0], kv_cache.shape[2], kv_cache.shape[3],
                        kv_dt, _p(out), DTYPES[dtype])
    return out


def _kv_dt(kv_cache: torch.Tensor, dtype: torch.dtype) -> int:
    """The C kernels' kind of a cache under ``dtype`` activations: 0 the model's own dtype, else ``KV_DTYPES``'
    (a bfloat16 cache only under float32); ValueError for a cache they cannot read under ``dtype``."""
    if kv_cache.dtype == dtype:
        return 0
    kv_dt = KV_DTYPES.get(kv_cache.dtype)
    if kv_dt is None or (kv_cache.dtype == torch.bfloat16 and dtype != torch.float32):
        raise ValueError(f"the CPU kernels read no {kv_cache.dtype} KV cache under {dtype} activations")
    return kv_dt


def _kv_args(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[int, int | None]:
    """(kv_dt, kv_scale pointer) for the C kernels; an 8-bit cache must come with its float32 scales."""
    kv_dt = _kv_dt(kv_cache, dtype)
    scaled = kv_cache.dtype in SCALED_KV
    if scaled and (kv_scale is None or kv_scale.dtype != torch.float32 or not kv_scale.is_contiguous()):
        raise ValueError(f"a {kv_cache.dtype} KV cache needs its contiguous float32 kv_scale")
    return kv_dt, _p(kv_scale) if scaled else None


def _kinds() -> dict[str, int]:
    """The C file's ids of a Gemma norm and of GeGLU (Llama's RMSNorm and SwiGLU are 0), read from it once."""
    if not _Loaded.kinds:
        _Loaded.kinds = {"unit_offset": int(_lib().pr_abi(5)), "gelu_tanh": int(_lib().pr_abi(6))}
    return _Loaded.kinds


def _matrix(matrix, dtype: torch.dtype, k: int) -> _Matrix:
    """A description's matrix (``parts``: (tensor, type) stacked by output rows; ``lora``: its adapter slots or
    None) as the C struct, checked: PLAIN parts contiguous [rows, k] in the model dtype, GGUF ones their blocks of
    k inputs, slots as ``cpu_lora_delta`` takes them."""
    if not 1 <= len(matrix.parts) <= MAX_PARTS:
        raise ValueError(f"a decode-stack matrix has 1..{MAX_PARTS} parts, not {len(matrix.parts)}")
    parts = []
    for weight, qtype in matrix.parts:
        if qtype == PLAIN:
            if weight.dtype != dtype or weight.shape[-1] != k or not weight.is_contiguous():
                raise ValueError(f"a plain part must be a contiguous {dtype} [N, {k}] tensor")
        else:
            _gguf_weight(weight, qtype, k)
        parts.append(_Part(weight.data_ptr(), weight.shape[0], qtype))
    lora = matrix.lora
    slots = _LoRA() if lora is None else _lora_slots(lora.a, lora.b, lora.slices, dtype, k,
                                                      sum(part.rows for part in parts))
    return _Matrix((_Part * MAX_PARTS)(*parts), len(parts), slots)


def _norm(norm, dtype: torch.dtype, width: int) -> _Norm:
    if norm is None:
        return _Norm(None, 0)
    if norm.weight.dtype != dtype or norm.weight.shape != (width,) or not norm.weight.is_contiguous():
        raise ValueError(f"a decode-stack norm's weight must be a contiguous {dtype} [{width}] tensor")
    return _Norm(norm.weight.data_ptr(), _kinds()["unit_offset"] if norm.unit_offset else 0)


def _layer_weights(d, dtype: torch.dtype) -> _LayerWeights:
    """One layer description (``layers/decode_plan.LayerDescription``) as the C struct, checked."""
    hidden, q_size = d.attn_norm.weight.shape[0], d.heads * d.head_dim
    intermediate = sum(w.shape[0] for w, _ in d.gate_up.parts) // 2
    widths = {"attn_norm": hidden, "q_norm": d.head_dim, "k_norm": d.head_dim, "attn_out_norm": hidden,
              "mlp_norm": hidden, "mlp_out_norm": hidden}
    norms = [_norm(getattr(d, name), dtype, widths[name]) for name in NORMS]
    inputs = {"qkv": hidden, "o": q_size, "gate_up": hidden, "down": intermediate}
    matrices = [_matrix(getattr(d, name), dtype, inputs[name]) for name in MATRICES]
    bias = d.qkv.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        raise ValueError(f"the qkv bias must be a contiguous {dtype} tensor")
    activation = _kinds()["gelu_tanh"] if d.activation == "gelu_tanh" else 0
    return _LayerWeights(*norms, _p(bias), *matrices, hidden, intermediate, activation, d.eps)


def _stack_layer(d, weights: _LayerWeights, dtype: torch.dtype) -> _StackLayer:
    if d.cos.dtype != torch.float32 or not (d.cos.is_contiguous() and d.sin.is_contiguous()) \
            or d.cos.shape[-1] != d.rot:
        raise ValueError(f"a layer's RoPE tables must be contiguous float32 [positions, {d.rot}]")
    _kv_args(d.kv_cache, d.kv_scale, dtype)  # a cache the kernels read, an 8-bit one with its scales
    return _StackLayer(ctypes.pointer(weights), _p(d.kv_cache), _p(d.kv_scale), d.window or 0, d.scale,
                       d.softcap or 0., _p(d.cos), _p(d.sin), d.rot)


class DecodeStack:
    """A model's decoder layers as one C call runs them, built once from their descriptions
    (``layers/decode_plan.LayerDescription``, read by attribute: kernels import no layer): the StackLayer
    array, and every tensor it points into held here, so the array stays valid as long as this object.
    Weights and caches must not move after it is built (a model's never do; the runner allocates its caches
    once)."""

    def __init__(self, layers: list, dtype: torch.dtype) -> None:
        first = layers[0]
        if any((d.heads, d.kv_heads, d.head_dim) != (first.heads, first.kv_heads, first.head_dim) for d in layers):
            raise ValueError("a decode stack's layers share their head counts and head size")
        self.dtype, self.heads, self.kv_heads, self.dim = dtype, first.heads, first.kv_heads, first.head_dim
        self.kv_dt = _kv_dt(first.kv_cache, dtype)
        # whether any matrix has adapter slots (then a step's rows may run adapters)
        self.lora = any(getattr(d, name).lora is not None for d in layers for name in MATRICES)
        # The most rows a call takes (None: any). Products take MAX_ROWS rows a pass, each thread's run of the
        # weights staying in its cache between passes. Op by op, GGUF blocks take the same kernel in the same
        # passes, so one call only saves the per-op dispatch (the default model's 128 requests: 1.16x, 2-core
        # Zen 3, benchmarks/ab_compare.py); plain weights take oneDNN's GEMMs there (packed on AVX-512), not measured
        # against the passes, so a stack with any plain matrix keeps to max_rows().
        plain = any(qtype == PLAIN for d in layers for name in MATRICES for _, qtype in getattr(d, name).parts)
        self.max_rows = max_rows() if plain else None
        self.layers = layers  # keeps every tensor the array points into alive
        self.weights = [_layer_weights(d, dtype) for d in layers]  # the structs the array's pointers name
        self.array = (_StackLayer * len(layers))(*(_stack_layer(d, w, dtype) for d, w in zip(layers, self.weights)))

    def run(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
            lora_slots: torch.Tensor | None = None) -> None:
        """The layers over a step of one-token query rows (at most ``self.max_rows``, where the caller routes), in
        one call (one thread team): each stores its K/V in its cache, x (the first layer's input) becomes the
        last layer's output and residual is advanced (zeros before the first layer). ``positions``: the rows of
        the RoPE tables. ``lora_slots``: each row's adapter slot (int64, -1: none; ``LoRAStep.row_slots``), or
        None: no row runs one; its delta joins every product of a matrix with slots, as ``cpu_lora_delta`` adds it
        op by op."""
        if x.dtype != self.dtype:
            raise ValueError(f"this decode stack computes in {self.dtype}, not {x.dtype}")
        if lora_slots is not None and not self.lora:
            raise ValueError("this decode stack's layers have no adapter slots")
        cpu_decode_stack(x, residual, ctypes.addressof(self.array), len(self.layers), positions, slots, block_tables,
                         context_lens, block_size, self.heads, self.kv_heads, self.dim, self.kv_dt, lora_slots)


@_op("cpu_decode_stack(Tensor(a!) x, Tensor(b!) residual, int stack, int num_layers, Tensor positions, "
     "Tensor slots, Tensor block_tables, Tensor context_lens, int block_size, int heads, int kv_heads, int dim, "
     "int kv_dt, Tensor? lora_slots=None) -> ()",
     lambda *args, **kwargs: None)
def cpu_decode_stack(x: torch.Tensor, residual: torch.Tensor, stack: int, num_layers: int, positions: torch.Tensor,
                     slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                     heads: int, kv_heads: int, dim: int, kv_dt: int, lora_slots: torch.Tensor | None = None) -> None:
    """``DecodeStack.run``'s call: ``stack`` is the address of a live DecodeStack's array of ``num_layers``
    layers (its K/V caches are written through it). Index tensors int64, contiguous (checked: the C code reads
    them raw); ``lora_slots`` one per row (the C code checks each against the slots)."""
    index = (positions, slots, block_tables, context_lens) + (() if lora_slots is None else (lora_slots,))
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index):
        raise ValueError("cpu_decode_stack takes contiguous int64 indices")
    if lora_slots is not None and lora_slots.shape != positions.shape:
        raise ValueError(f"lora_slots must have one entry per row, {positions.shape[0]}")
    paged = _Paged(_p(block_tables), _p(context_lens), block_tables.stride(0), block_size, heads, kv_heads, dim, 0,
                   0., 0., kv_dt, None)
    step = _DecodeStep(positions.shape[0], _p(positions), _p(slots), _p(lora_slots), paged)
    rc = _lib().pr_decode_layers(stack, num_layers, ctypes.byref(step), _p(x), _p(residual), DTYPES[x.dtype])
    if rc:
        raise RuntimeError(f"pr_decode_layers failed ({rc}) for {x.shape[0]} rows")


# ---- GGUF block-quantized weights ---------------------------------------------------------------------
def _gguf_x8() -> int:
    """The flag a packed weight's type id carries (GGUF_X8 in the C file)."""
    if not _Loaded.gguf_x8:  # read once: the ops check it at every call
        _Loaded.gguf_x8 = int(_lib().pr_gguf_abi(2))
    return _Loaded.gguf_x8


def gguf_pack_x8(weight: torch.Tensor, qtype: int, k: int) -> tuple[torch.Tensor, int] | None:
    """GGUF rows ``weight`` repacked 8 at a time (the C file's x8 layout: an output row per vector lane, the
    batched product's fast form) and the type id the kernels take it under; None where the type has no such
    layout or the rows are not a multiple of 8. Same shape and bytes per row; every batch size multiplies
    a packed weight with one arithmetic, as it does an unpacked one."""
    _gguf_weight(weight, qtype, k)
    out = torch.empty_like(weight)
    if _lib().pr_gguf_pack_x8(_p(weight), _p(out), weight.shape[0], k, qtype):
        return None
    return out, qtype | _gguf_x8()


def gguf_has_vector_paths() -> bool:
    """Whether the loaded library has the GGUF kernels' AVX2 paths (else every type runs its scalar loop)."""
    return bool(_lib().pr_gguf_abi(1))


def gguf_force_scalar(on: bool) -> None:
    """Run the GGUF kernels' scalar paths even where the vector ones exist (for tests), or stop doing so."""
    _lib().pr_gguf_force_scalar(int(on))


def attention_tile_rows(n: int) -> None:
    """Attend up to n (1-8) rows of one sequence together from now on (8, the default: a prompt chunk's rows
    read each key and value once per tile; 1: every row alone, as benchmarks compare). Same bits either way."""
    _lib().pr_attention_tile_rows(n)


_gguf_row_bytes = functools.lru_cache(maxsize=256)(gguf_types.row_bytes)  # a few us a call saved


def _gguf_weight(weight: torch.Tensor, qtype: int, k: int) -> None:
    """Raise unless ``weight`` is a contiguous uint8 [N, row_bytes(qtype, k)] tensor (the C code reads it raw;
    a packed type's rows are its base type's bytes, in whole groups of 8)."""
    base = qtype & ~_gguf_x8()
    expected = _gguf_row_bytes(base, k)  # raises for an unknown type or a k that is not whole blocks
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != expected or not weight.is_contiguous():
        raise ValueError(f"a {gguf_types.gguf_type(base).name} weight of {k} inputs per row must be a contiguous "
                         f"uint8 [N, {expected}] tensor, not {weight.dtype} {list(weight.shape)}")
    if base != qtype and weight.shape[0] % 8:
        raise ValueError(f"a packed {gguf_types.gguf_type(base).name} weight has whole groups of 8 rows, "
                         f"not {weight.shape[0]}")


def _gguf_linear_fake(x, weight, bias, qtype, k):
    return x.new_empty(x.shape[0], weight.shape[0])


@_op("cpu_gguf_linear(Tensor x, Tensor weight, Tensor? bias, int qtype, int k) -> Tensor", _gguf_linear_fake)
def cpu_gguf_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qtype: int,
                    k: int) -> torch.Tensor:
    """x [M, k] @ dequant(weight).T (+ bias): ``weight`` the GGUF blocks of ggml type ``qtype``
    (uint8 [N, row bytes]; or ``gguf_pack_x8``'s repacking and type id), never dequantized whole. x is
    rounded to int8 per 32 inputs first, as llama.cpp does (see the C file): not bit-equal to
    x @ dequantized.T. Row m of the result does not depend on the other rows of x."""
    _gguf_weight(weight, qtype, k)
    (m, kx), n = x.shape, weight.shape[0]
    if kx != k or x.dtype not in DTYPES or not x.is_contiguous() or m < 1:
        raise ValueError(f"cpu_gguf_linear takes a contiguous float32/bfloat16 x of rows of {k}, not {x.dtype} "
                         f"{list(x.shape)}")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"the bias must be a contiguous {x.dtype} [{n}] tensor")
    out = torch.empty(m, n, dtype=x.dtype)
    if _lib().pr_gguf_linear(_p(x), _p(weight), _p(bias), _p(out), m, n, k, qtype, DTYPES[x.dtype]):
        raise RuntimeError(f"pr_gguf_linear failed for a {m}x{k} input")
    return out


@_op("cpu_gguf_dequantize(Tensor weight, int qtype, int k, ScalarType dtype) -> Tensor",
     lambda weight, qtype, k, dtype: weight.new_empty(weight.shape[0], k, dtype=dtype))
def cpu_gguf_dequantize(weight: torch.Tensor, qtype: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The [N, k] float32 or bfloat16 matrix of GGUF rows ``weight`` (uint8 [N, row bytes], ggml type
    ``qtype``): gguf.quants.dequantize's values (bfloat16: those, rounded once)."""
    _gguf_weight(weight, qtype, k)
    if dtype not in DTYPES:
        raise ValueError(f"cpu_gguf_dequantize makes float32 or bfloat16, not {dtype}")
    out = torch.empty(weight.shape[0], k, dtype=dtype)
    if _lib().pr_gguf_dequantize(_p(weight), _p(out), weight.shape[0], k, qtype, DTYPES[dtype]):
        raise RuntimeError(f"pr_gguf_dequantize failed for {weight.shape[0]} rows of {k}")
    return out
