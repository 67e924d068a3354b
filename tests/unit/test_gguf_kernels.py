"""The GGUF block kernels (cpu_ops.c, GGUF section) against the gguf package's reference dequantization.

Dequantization must equal ``gguf.quants.dequantize`` exactly (fp32; bf16 is that value rounded once). The
linear rounds each 32-run of an x row to int8 first (llama.cpp's scheme), so it is checked two ways:
against the same rounding emulated in torch (then only fp32 summation order differs: a relative 1e-5 of
the sum of |terms|), and against the exact x @ dequant(w).T within the bound that rounding allows
(each x element moves by at most half its run's step, max|x| / 254, so the sum by sum |w| * that).
Both the AVX2 and the scalar paths run (``gguf_force_scalar``), and a build without AVX2 is checked too.
Weights repacked 8 rows at a time (``gguf_pack_x8``) pass the same checks, and their one arithmetic is
checked bit for bit: scalar against vector, a batch against its rows one by one, one build against another.
"""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch

from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu
from paged_runtime.kernels.gguf_types import GGUF_TYPES, gguf_type, row_bytes, supported_names

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")

WITH_MIN = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
PATHS = ("vector", "scalar")
PACKABLE = tuple(supported_names())  # every type has the x8 layout


def make_weight(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random but valid GGUF rows: random bytes with every fp16 scale field set to a finite value (a few
    special ones among them: zero, a subnormal, negatives)."""
    rng = np.random.default_rng(seed)
    t = GGUF_TYPES[name]
    raw = rng.integers(0, 256, size=(n, row_bytes(t, k)), dtype=np.uint8)
    blocks = raw.reshape(n, k // t.block_elems, t.block_bytes)
    for offset in ((208,) if name == "Q6_K" else (0, 2) if name in WITH_MIN else (0,)):
        d = rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16)
        d.flat[:3] = [0.0, 2.0 ** -20, -(2.0 ** -16)]
        blocks[:, :, offset:offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def reference(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float32))


def shapes(name: str) -> list[int]:
    """Ks of whole blocks; the linear takes runs of 32 eight at a time, then one by one: 96 is only the
    latter, 320 both, 256 and 512 (K-blocks of 8 runs) only the former."""
    return [256, 512] if GGUF_TYPES[name].block_elems == 256 else [96, 320]


@pytest.fixture(params=PATHS)
def path(request):
    if request.param == "vector" and not cpu.gguf_has_vector_paths():
        pytest.skip("this CPU has no AVX2: the library has only the scalar paths")
    cpu.gguf_force_scalar(request.param == "scalar")
    yield request.param
    cpu.gguf_force_scalar(False)


def test_type_table_matches_the_gguf_package():
    for name in supported_names():
        t = gguf_type(name)
        assert gguf.GGMLQuantizationType[name] == t.id and gguf_type(t.id) is t
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (t.block_elems, t.block_bytes)
    assert row_bytes("q4_1", 576) == 576 // 32 * 20
    with pytest.raises(ValueError, match="Q4_0 \\(2\\)"):
        gguf_type("IQ2_XS")
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes("Q4_K", 576)


@pytest.mark.parametrize("name", supported_names())
def test_dequantize_equals_the_gguf_package(name, path):
    for k in shapes(name):
        raw = make_weight(name, 37, k)
        ref = reference(raw, name)
        w = torch.from_numpy(raw)
        out = cpu.cpu_gguf_dequantize(w, gguf_type(name).id, k, torch.float32)
        assert torch.equal(out, ref)
        assert torch.equal(cpu.cpu_gguf_dequantize(w, gguf_type(name).id, k, torch.bfloat16), ref.bfloat16())
        assert torch.equal(cpu.cpu_gguf_dequantize(w[5:6], gguf_type(name).id, k, torch.float32), ref[5:6])


def int8_runs(x: torch.Tensor) -> torch.Tensor:
    """x with each 32-run rounded as the kernel does: step d = max|x| / 127, x -> round(x / d) * d."""
    runs = x.float().reshape(x.shape[0], -1, 32)
    d = runs.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(runs * inv) * d).reshape(x.shape)


def weight_as(name: str, n: int, k: int, packed: bool, seed: int = 0) -> tuple[np.ndarray, torch.Tensor, int]:
    """make_weight's rows, and the tensor and type id the kernels take them as (repacked if asked)."""
    raw = make_weight(name, n, k, seed)
    w, qtype = torch.from_numpy(raw), gguf_type(name).id
    if packed:
        w, qtype = cpu.gguf_pack_x8(w, qtype, k)
    return raw, w, qtype


@pytest.mark.parametrize("name,packed", [(n, False) for n in supported_names()] + [(n, True) for n in PACKABLE])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_linear_matches_the_dequantized_product(name, packed, dtype, path):
    n = 40 if packed else 37
    for k in shapes(name):
        raw, w, qtype = weight_as(name, n, k, packed, seed=k)
        ref_w = reference(raw, name).double()
        for m in (1, 3, 16, 37):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            bias = torch.randn(n).to(dtype)
            for b in (None, bias):
                out = cpu.cpu_gguf_linear(x, w, b, qtype, k).double()
                shift = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
                # the same int8 rounding of x: only fp32 summation order (and one bf16 rounding) apart
                xq = int8_runs(x).double()
                ref = xq @ ref_w.T + shift
                slack = 1e-5 * (xq.abs() @ ref_w.abs().T + shift.abs()) + 1e-30
                if dtype == torch.bfloat16:
                    slack = slack + 2 ** -8 * ref.abs()
                assert ((out - ref).abs() <= slack).all()
                # the exact product, within what the rounding of x allows
                xd = x.double()
                step = xd.reshape(m, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(m, k) / 254
                exact = xd @ ref_w.T + shift
                assert ((out - exact).abs() <= step @ ref_w.abs().T + slack).all()


@pytest.mark.parametrize("name", PACKABLE)
def test_packed_weights_hold_the_same_values(name):
    for k in shapes(name):
        raw, w, qtype = weight_as(name, 40, k, packed=True)
        assert w.shape == raw.shape and not torch.equal(w, torch.from_numpy(raw))
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(cpu.cpu_gguf_dequantize(w, qtype, k, dtype), reference(raw, name).to(dtype))


@pytest.mark.parametrize("name", PACKABLE)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_packed_linear_has_one_arithmetic(name, dtype):
    """Bit for bit: the vector path gives the scalar path's result, and a row of a batch (37 rows: 16-row
    passes, 4-row groups and their remainders) what it gives alone."""
    k = shapes(name)[1]
    _, w, qtype = weight_as(name, 48, k, packed=True)
    x, bias = torch.randn(37, k).to(dtype), torch.randn(48).to(dtype)
    outs = []
    for scalar in (False, True):
        cpu.gguf_force_scalar(scalar)
        try:
            whole = cpu.cpu_gguf_linear(x, w, bias, qtype, k)
            alone = torch.cat([cpu.cpu_gguf_linear(x[i:i + 1].contiguous(), w, bias, qtype, k) for i in range(37)])
        finally:
            cpu.gguf_force_scalar(False)
        assert torch.equal(whole, alone)
        outs.append(whole)
    assert torch.equal(outs[0], outs[1])


def test_only_whole_groups_of_known_types_pack():
    assert cpu.gguf_pack_x8(torch.from_numpy(make_weight("Q4_1", 12, 64)), gguf_type("Q4_1").id, 64) is None
    assert cpu.gguf_pack_x8(torch.from_numpy(make_weight("Q6_K", 12, 256)), gguf_type("Q6_K").id, 256) is None
    _, w, qtype = weight_as("Q4_1", 16, 64, packed=True)
    with pytest.raises(ValueError, match="whole groups of 8"):
        cpu.cpu_gguf_linear(torch.randn(1, 64), w[:12].contiguous(), None, qtype, 64)


def test_a_tied_vocabulary_repacks_once_and_looks_rows_up_by_id():
    """The GGUF method repacks a Q8_0 vocabulary; the LM head tied to it holds the same tensor, and the
    embedding's lookups (each id's group of 8 rows dequantized) give the file's rows."""
    from torch import nn

    from paged_runtime.layers.linear import SINGLE
    from paged_runtime.layers.quantization.gguf import GGUFLinearMethod
    method, raw = GGUFLinearMethod(cpu), make_weight("Q8_0", 40, 64)
    embedding, head = nn.Module(), nn.Module()
    for layer in (embedding, head):
        layer.tp, layer.input_size = SINGLE, 64
        method.create_weights(layer, torch.float32, torch.device("cpu"))
    embedding.qweight.weight_loader(embedding.qweight, torch.from_numpy(raw))
    embedding.qweight_type.weight_loader(embedding.qweight_type, torch.full((40,), gguf_type("Q8_0").id))
    method.tie(head, embedding)
    for layer in (embedding, head):
        method.process_weights_after_loading(layer)
    (_, kernel_id, packed), = method.segments(embedding)
    assert kernel_id == gguf_type("Q8_0").id | 256 and head.qweight_0 is packed
    ids = torch.tensor([0, 7, 8, 39, 13, 13])
    assert torch.equal(method.embed(embedding, ids), reference(raw, "Q8_0")[ids])


def test_linear_rejects_bad_input():
    raw = torch.from_numpy(make_weight("Q4_1", 8, 64))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="Q4_K"):
        cpu.cpu_gguf_linear(x, raw, None, 99, 64)
    with pytest.raises(ValueError, match="uint8 \\[N, 40\\]"):
        cpu.cpu_gguf_linear(x, raw[:, :20], None, 3, 64)
    with pytest.raises(ValueError, match="rows of 64"):
        cpu.cpu_gguf_linear(torch.randn(0, 64), raw, None, 3, 64)
    with pytest.raises(ValueError, match="bias"):
        cpu.cpu_gguf_linear(x, raw, torch.zeros(7), 3, 64)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu.cpu_gguf_dequantize(raw, 3, 64, torch.float16)


def test_ops_trace_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        w = torch.empty(37, 40, dtype=torch.uint8)
        assert torch.ops.paged_runtime.cpu_gguf_linear(torch.empty(3, 64), w, None, 3, 64).shape == (3, 37)
        out = torch.ops.paged_runtime.cpu_gguf_dequantize(w, 3, 64, torch.bfloat16)
        assert out.shape == (37, 64) and out.dtype == torch.bfloat16


def test_a_build_without_avx2_runs_the_scalar_paths(tmp_path):
    """The library compiled for a baseline x86-64 (no AVX, no F16C: the portable fp16 conversion) gives
    the same dequantization and, up to summation order, the same linear."""
    compiler = cpu._compiler()
    if compiler is None or "x86_64" not in subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout:
        pytest.skip("needs a C compiler on x86-64")
    so = tmp_path / "baseline.so"
    subprocess.run([compiler, "-O2", "-march=x86-64", "-fopenmp", "-shared", "-fPIC", "-std=c11", str(cpu.SOURCE),
                    "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    cpu._bind(lib)
    assert lib.pr_gguf_abi(1) == 0
    for name in supported_names():
        k, qtype = shapes(name)[0], gguf_type(name).id
        raw = make_weight(name, 37, k)
        ref, w = reference(raw, name), torch.from_numpy(raw)
        out = torch.empty(37, k)
        assert lib.pr_gguf_dequantize(w.data_ptr(), out.data_ptr(), 37, k, qtype, 0) == 0
        assert torch.equal(out, ref)
        x, y = torch.randn(3, k), torch.empty(3, 37)
        assert lib.pr_gguf_linear(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 3, 37, k, qtype, 0) == 0
        xq = int8_runs(x).double()
        assert ((y.double() - xq @ ref.double().T).abs() <= 1e-5 * (xq.abs() @ ref.double().abs().T)).all()
    for name in PACKABLE:  # the packed arithmetic is the same bits in any build
        k = shapes(name)[1]
        _, w, qtype = weight_as(name, 40, k, packed=True)
        x, y = torch.randn(5, k), torch.empty(5, 40)
        assert lib.pr_gguf_linear(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 5, 40, k, qtype, 0) == 0
        assert torch.equal(y, cpu.cpu_gguf_linear(x, w, None, qtype, k))


def test_the_amx_path_gives_the_vector_paths_bits(tmp_path):
    """The x8 kernel's AMX path (from 16 x rows, two groups of 8 columns a tile) built with its tile instructions
    emulated in C (PR_AMX_EMULATE, on top of this CPU's own build; unoptimized, for time: the same bits), and
    this CPU's own build (its tile instructions where it has AMX), give the vector path's bits (each row alone)
    for every type: one full tile (16 rows), a full and a zero-padded one (25), and 32 + 5 rows (the 5 on the
    vector path); 40 columns, so a thread's range can end on an odd group, which the vector path takes. On one
    thread the tile products it ran are exactly what the shapes call for: a pair of groups per 16 columns, a
    product a run and 16 rows (two for Q6_K's halves of 16)."""
    compiler = cpu._compiler()
    if compiler is None or not cpu.gguf_has_vector_paths():
        pytest.skip("needs a C compiler and the AVX2 paths (the AMX path is built on them)")
    so = tmp_path / "amx_emulated.so"
    subprocess.run([compiler, *cpu.ISAS[cpu.info()["isa"]].flags, "-O0", "-DPR_AMX_EMULATE", "-fopenmp", "-shared",
                    "-fPIC", "-std=c11", str(cpu.SOURCE), "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    cpu._bind(lib)
    assert lib.pr_kernel_variants().decode().endswith(" gguf_x8=amx_int8_emulated")
    assert cpu._lib().pr_gguf_abi(3) == 0  # the count exists in emulated builds only
    threads = torch.get_num_threads()
    for name in PACKABLE:
        k = shapes(name)[1]
        _, w, qtype = weight_as(name, 40, k, packed=True, seed=3)
        for m in (16, 25, 37):
            for dtype in (torch.float32, torch.bfloat16):
                x, bias = torch.randn(m, k).to(dtype), torch.randn(40).to(dtype)
                # The vector path's bits: a row alone never reaches a tile (each row's arithmetic is its own).
                by_row = torch.cat([cpu.cpu_gguf_linear(x[i:i + 1], w, bias, qtype, k) for i in range(m)])
                # This CPU's own build, which takes the tiles itself where it has AMX.
                assert torch.equal(cpu.cpu_gguf_linear(x, w, bias, qtype, k), by_row), (name, m, dtype)
                for one_thread in (False, True):
                    torch.set_num_threads(1 if one_thread else threads)
                    try:
                        before, out = lib.pr_gguf_abi(3), torch.empty(m, 40, dtype=dtype)
                        assert lib.pr_gguf_linear(x.data_ptr(), w.data_ptr(), bias.data_ptr(), out.data_ptr(), m, 40,
                                                  k, qtype, int(dtype == torch.bfloat16)) == 0
                        ran = lib.pr_gguf_abi(3) - before
                    finally:
                        torch.set_num_threads(threads)
                    assert torch.equal(out, by_row), (name, m, dtype)
                    if one_thread:
                        tiles = {16: 1, 25: 2, 37: 2}[m]  # the 32-row pass's; 5 rows are too few for a tile
                        assert ran == 2 * (k // 32) * tiles * (2 if name == "Q6_K" else 1), (name, m)
