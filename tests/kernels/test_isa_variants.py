"""The tests whose results depend on the compiled CPU kernels' instruction set, run again for each other ISA this
CPU can run (``$PAGED_RUNTIME_CPU_ISA``), in a fresh process each: the library is process-wide.

The rest of the suite runs the build for this CPU ("auto"). Machines of one kind differ (AVX2-only Zen 3,
AVX-512 Zen 4 with VNNI), so a bound tuned on one build's rounding must hold on the others: an AVX-512 CPU
runs the AVX2 build here as well, a VNNI one the AVX-512 build without VNNI (the GGUF x8 kernel's other
integer path), one with AVX-VNNI too the AVX-VNNI build (its 256-bit VEX form), and every x86-64 CPU the scalar
one (the plain loops a CPU without AVX2 runs).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu

pytestmark = [pytest.mark.kernels, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]
# Each file's arithmetic goes through the C kernels' float sums, exp or their int8 activation rounding.
SENSITIVE = {
    # On an AMX CPU the GGUF x8 kernel's batches of 16 rows and more go through tile products: its VNNI path
    # takes them in this build.
    "avx512_vnni": ["unit/test_gguf_kernels.py", "unit/test_gguf_blocks_served.py"],
    # Only the GGUF x8 kernel differs from the VNNI build (its maddubs integer path), which these check bit for
    # bit against the scalar arithmetic and serve whole models through.
    "avx512": ["unit/test_gguf_kernels.py", "unit/test_gguf_blocks_served.py"],
    # The GGUF x8 kernel's 256-bit VEX vpdpbusd (Alder Lake, Sapphire Rapids, Zen 5): where the CPU has AVX-512
    # too, its own build takes the EVEX form, so the VEX one runs only here.
    "avx_vnni": ["unit/test_gguf_kernels.py", "unit/test_gguf_blocks_served.py"],
    "avx2": ["unit/test_cpu_kernels.py", "unit/test_kv_quant.py", "unit/test_gguf_kernels.py",
             "unit/test_gguf_blocks_served.py", "unit/test_rotary.py", "unit/test_moe_layer.py",
             "e2e/test_cpu_kernels_identity.py", "e2e/test_kv_cache_dtype.py", "e2e/test_quantization.py",
             "kernels/test_lora_kernels.py"],
    # The plain loops: what a CPU without AVX2 would run (the kernels must be forced on there: they lose to
    # PyTorch, so "auto" leaves them off).
    "scalar": ["unit/test_cpu_kernels.py", "unit/test_kv_quant.py", "unit/test_gguf_kernels.py",
               "e2e/test_cpu_kernels_identity.py", "kernels/test_lora_kernels.py"],
}
# The ISAs whose presence makes "auto" build other kernels than the key's: without any of them, the key's
# build is this CPU's own, which the rest of the suite runs already.
BETTER = {"avx512_vnni": ["amx"], "avx512": ["avx512_vnni"], "avx_vnni": ["avx512"], "avx2": ["avx512", "avx_vnni"],
          "scalar": []}


@pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")
@pytest.mark.parametrize("isa", sorted(SENSITIVE))
def test_the_kernel_sensitive_tests_pass_with_each_isa_this_cpu_runs(isa):
    if not cpu.cpu_has(isa):
        pytest.skip(f"this CPU cannot run the {isa} build")
    if BETTER[isa] and not any(cpu.cpu_has(better) for better in BETTER[isa]):
        pytest.skip(f"no {' or '.join(BETTER[isa])} here: this CPU's own build is the {isa} one, which the rest of "
                    "the suite runs")
    env = os.environ | {cpu.ISA_ENV: isa, "PAGED_RUNTIME_CPU_KERNELS": "1" if isa == "scalar" else ""}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *(str(TESTS / f) for f in SENSITIVE[isa])],
                         cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.mark.skipif(cpu._compiler() is None or platform.machine() != "x86_64", reason="needs a C compiler on x86-64")
def test_the_builds_this_cpu_cannot_run_still_compile(tmp_path):
    """A change is tested on one CPU, and machines of one kind differ (AVX2-only Zen 3, AVX-512 Zen 4): the builds
    this CPU cannot run (the rest of the suite builds the others) must still compile, or the CPUs that pick them
    lose their kernels. Unoptimized, side by side, for time: the same preprocessor branches, intrinsics and
    target checks."""
    others = [name for name in cpu.ISAS if name != "auto" and not cpu.cpu_has(name)]
    if not others:
        pytest.skip("this CPU runs every build")
    builds = {name: subprocess.Popen([cpu._compiler(), *cpu.ISAS[name].flags, "-O0", "-fopenmp", "-fPIC",
                                      "-std=c11", "-c", str(cpu.SOURCE), "-o", str(tmp_path / f"{name}.o")],
                                     stderr=subprocess.PIPE, text=True) for name in others}
    errors = {name: build.communicate(timeout=300)[1] for name, build in builds.items()}
    failed = {name: errors[name][-3000:] for name, build in builds.items() if build.returncode}
    assert not failed, failed
