"""benchmarks/int8_peak.c, the peak int8 dot-product rate issue 35's share-of-peak figure divides by: it builds for
this CPU and measures a rate. On an AMX CPU its tile configuration once reached ldtilecfg half unwritten (gcc 12's
intrinsic says it reads 8 bytes, so the stores of the shapes were dropped) and the program died of a fault. On
AMX it also measures the bound on a kernel that scales each GGUF block exactly."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

from paged_runtime.kernels import cpu

SOURCE = Path(__file__).resolve().parents[2] / "benchmarks" / "int8_peak.c"


@pytest.mark.skipif(cpu._compiler() is None or platform.machine() != "x86_64", reason="needs a C compiler on x86-64")
def test_the_peak_program_measures_a_rate(tmp_path):
    exe = tmp_path / "int8_peak"
    subprocess.run([cpu._compiler(), "-O2", "-march=native", "-fopenmp", str(SOURCE), "-o", str(exe)], check=True,
                   capture_output=True, timeout=120)
    # About a third of a second; the rate's size is the benchmark's business, only that it runs and prints one.
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    (gops, instruction), *bound = (line.split(maxsplit=1) for line in run.stdout.splitlines())
    expected = "tdpbssd (AMX)" if cpu.cpu_has("amx") else "vpdpbusd zmm" if cpu.cpu_has("avx512_vnni") else None
    assert float(gops) > 0 and (expected is None or instruction.strip() == expected)
    # On AMX a second line: the bound on a kernel that scales each GGUF block exactly, below the tiles' peak.
    assert len(bound) == (1 if expected == "tdpbssd (AMX)" else 0)
    if bound:
        assert bound[0][1] == "tdpbssd with each GGUF block's exact scaling"
        assert 0 < float(bound[0][0]) < float(gops)
