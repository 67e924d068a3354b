"""Every Triton kernel the runtime launches compiles for Hopper (sm_90: the H100 and H200 issue 36 is measured
on) and Ampere (sm_80: the A100), in every variant the runtime launches there, with Triton's own compiler and
ptxas, on a machine without a GPU (``tests/helpers/gpu_compile.py``). The other kernel tests run interpreted
here, and the interpreter accepts code the compiler refuses: the 8-bit KV store's rounding constant, a plain
global, failed only on an H100; Ampere's Triton has no float8_e4m3fn, so there an fp8 cache goes through the
kernels as its bits (QUANT 3)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kernels, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LAUNCHED = {"_store_kv_kernel", "_paged_attention_kernel", "_reduce_segments_kernel", "_rms_norm_kernel",
            "_rope_kernel", "_silu_mul_kernel", "_shrink_kernel", "_expand_kernel", "_w8a16_kernel",
            "_w4a16_kernel", "_gguf_kernel"}


@pytest.mark.parametrize("arch", [90, 80])
def test_every_launched_kernel_compiles_for_the_gpu(arch):
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"the compile-only hook is written against Triton 3.9's JITFunction; this is {triton.__version__}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels compiled, not interpreted
    out = subprocess.run([sys.executable, "-m", "tests.helpers.gpu_compile", str(arch)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout)
    assert {label.split("[")[0] for label in results} == LAUNCHED
    failed = {label: error for label, error in results.items() if error != "ok"}
    assert not failed, "\n\n".join(f"{label}\n{error}" for label, error in failed.items())
    # float32 / float16 / bfloat16, 8-bit caches, K split and not, every GGUF type: 105 distinct launches
    assert len(results) == 105
