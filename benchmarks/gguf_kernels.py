"""The GGUF block kernels (``cpu_gguf_linear``) against bfloat16 ``F.linear`` on SmolLM2-135M's shapes.

What it measures
    For each weight shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536, LM
    head 49152x576; N x K) and M = 1, 16 and 128 rows (``--rows``) of bfloat16 activations (over 16: not the
    LM head, which a prefill multiplies by its last rows only): milliseconds per call and the weight bytes
    streamed per second, for the GGUF types Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, each also repacked 8 rows at a time as the
    engine holds them (``x8``, ``cpu.gguf_pack_x8``), and for a bfloat16 weight through ``F.linear``, all in
    the same run with torch on 2 threads. Each call reads a different copy of
    the weight (enough copies for 64 MiB) so the weights come from memory, not from the caches, as in a
    decode step over a whole model. K-quants need K a multiple of 256: 576 is not (n/a), as in llama.cpp.
    Best of ``--repeats`` timings of ``--calls`` calls each. Also ``cpu_gguf_dequantize`` of each weight to
    bfloat16 (the large-batch path dequantizes, then runs one GEMM), as ms and GB/s of weight bytes read.
    Last, the CPU's peak int8 dot-product rate on the same threads (``int8_peak.c``: independent chains of
    the widest u8 x s8 dot product the kernels' build flags allow, -march=native unless ``--cpu-isa`` says
    less: vpdpbusd on 512 bits on an AVX512-VNNI CPU, tdpbssd tile products where they allow AMX-INT8) and each
    x8 kernel's rate at 128 rows (2 N K M ops a call) as a share of it. On AMX also ``int8_peak.c``'s bound on
    any kernel that scales each GGUF block exactly, and the share of it reached by the types whose scaling it
    times (``BOUND_TYPES``).

How to run
    .venv/bin/python benchmarks/gguf_kernels.py   # about half a minute; run on a quiet machine

Writes benchmarks/results/gguf_kernels-cpu.json.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import machine_info, others_busy_cores, result_path, write_json  # noqa: E402

from paged_runtime.config import default_cache_dir  # noqa: E402
from paged_runtime.kernels import cpu  # noqa: E402
from paged_runtime.kernels.gguf_types import GGUF_TYPES, row_bytes  # noqa: E402

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536), "lm_head": (49152, 576)}
TYPES = ("Q4_1", "Q4_1 x8", "Q8_0", "Q8_0 x8", "Q4_K", "Q4_K x8", "Q5_K", "Q5_K x8", "Q6_K", "Q6_K x8")
STREAM_BYTES = 64 << 20  # copies of a weight cycled through: more than the last-level cache
# The x8 kernels whose per-block scaling int8_peak.c's AMX bound times (a minimum, one product a run): Q8_0 has
# no minimum and Q6_K two products a run, so their share of it would mislead.
BOUND_TYPES = ("Q4_1 x8", "Q4_K x8", "Q5_K x8")


def gguf_weight(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes with every fp16 scale field a small finite value (the kernels' speed ignores values)."""
    t = GGUF_TYPES[name]
    raw = torch.randint(0, 256, (n, row_bytes(t, k)), dtype=torch.uint8, generator=gen)
    blocks = raw.view(n, k // t.block_elems, t.block_bytes)
    scale = torch.full(blocks.shape[:2], 0.01, dtype=torch.float16).view(torch.uint8).view(*blocks.shape[:2], 2)
    for offset in (208,) if name == "Q6_K" else (0, 2):
        blocks[:, :, offset:offset + 2] = scale
    return raw


def best_ms(fn, weights: list, calls: int, repeats: int) -> float:
    for w in weights[:2]:
        fn(w)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(weights[i % len(weights)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def copies(one: torch.Tensor) -> list[torch.Tensor]:
    count = max(1, -(-STREAM_BYTES // (one.numel() * one.element_size())))
    return [one] + [one.clone() for _ in range(count - 1)]


def int8_peak(threads: int) -> dict | None:
    """The CPU's peak int8 dot-product rate on ``threads`` threads, measured by int8_peak.c built with the flags
    the kernels were (``--cpu-isa``: auto is -march=native, the widest u8 x s8 dot product this CPU has; an
    avx512_vnni build on an AMX CPU is measured against vpdpbusd, not the tiles it was built without), or None
    without a compiler."""
    compiler = cpu._compiler()
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        subprocess.run([compiler, "-O2", *cpu.ISAS[cpu.info()["isa"]].flags, "-fopenmp",
                        str(Path(__file__).with_name("int8_peak.c")), "-o", str(exe)], check=True, capture_output=True)
        lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True,
                               env=os.environ | {"OMP_NUM_THREADS": str(threads)}).stdout.splitlines()
    (gops, instruction), *bound = (line.split(maxsplit=1) for line in lines)
    peak = {"gops": float(gops), "instruction": instruction.strip(), "threads": threads}
    if bound:  # AMX: what an exact GGUF-block-scaled kernel can reach at most (int8_peak.c)
        peak |= {"block_scaled_gops": float(bound[0][0]), "block_scaled": bound[0][1].strip()}
    return peak


def share_of_peak(rows: list[dict], peak: dict | None) -> list[dict]:
    """The x8 kernels at 128 rows as int8 rates (2 N K M ops a call) and their share of ``peak``."""
    if not peak or not peak["gops"]:
        return []
    out = []
    for r in rows:
        if r["m"] == 128 and r["method"].endswith("x8") and r["ms"] is not None:
            gops = 2 * r["n"] * r["k"] * r["m"] / r["ms"] / 1e6
            out.append({"shape": r["shape"], "method": r["method"], "gops": gops, "share": gops / peak["gops"]})
            if peak.get("block_scaled_gops") and r["method"] in BOUND_TYPES:
                out[-1]["share_of_block_scaled"] = gops / peak["block_scaled_gops"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128],
                        help="rows of x (M) to time; the LM head skips those over 16")
    parser.add_argument("--out", default=str(result_path("gguf_kernels", device="cpu")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu.load(default_cache_dir()):
        sys.exit("the CPU kernels did not build (no C compiler?)")
    busy_before = others_busy_cores()
    gen = torch.Generator().manual_seed(0)
    rows, table, dequant = [], [], []
    for shape, (n, k) in SHAPES.items():
        for m in [m for m in args.rows if shape != "lm_head" or m <= 16]:
            x = torch.randn(m, k, generator=gen).bfloat16()
            dense = torch.randn(n, k, generator=gen).bfloat16()
            cells = {"bf16": (best_ms(lambda w: F.linear(x, w), copies(dense), args.calls, args.repeats),
                              dense.numel() * 2)}
            for name in TYPES:
                base, packed = name.split()[0], name.endswith("x8")
                if k % GGUF_TYPES[base].block_elems:
                    cells[name] = (None, None)
                    continue
                w, qtype = gguf_weight(base, n, k, gen), GGUF_TYPES[base].id
                if packed:
                    w, qtype = cpu.gguf_pack_x8(w, qtype, k)
                ms = best_ms(lambda w: cpu.cpu_gguf_linear(x, w, None, qtype, k), copies(w), args.calls, args.repeats)
                cells[name] = (ms, w.numel())
                if m == 1 and not packed:
                    ms = best_ms(lambda w: cpu.cpu_gguf_dequantize(w, qtype, k, torch.bfloat16), copies(w),
                                 max(2, args.calls // 4), args.repeats)
                    dequant.append({"shape": shape, "n": n, "k": k, "method": name, "ms": ms, "weight_bytes": w.numel(),
                                    "gb_s": w.numel() / ms / 1e6})
            for method, (ms, nbytes) in cells.items():
                rows.append({"shape": shape, "n": n, "k": k, "m": m, "method": method, "ms": ms,
                             "weight_bytes": nbytes, "gb_s": None if ms is None else nbytes / ms / 1e6})
            table.append((shape, n, k, m, cells))
    peak = int8_peak(args.threads)
    result = {"machine": machine_info(), "threads": args.threads, "others_busy_cores": (busy_before, others_busy_cores()),
              "load_average": os.getloadavg(), "gguf_vector_paths": cpu.gguf_has_vector_paths(), "rows": rows,
              "dequantize_bf16": dequant, "int8_peak": peak, "x8_share_of_peak": share_of_peak(rows, peak)}
    write_json(args.out, result, indent=1)
    methods = ("bf16", *TYPES)
    print(f"{'shape':9}{'N x K':>12}{'M':>4}  " + "".join(f"{m + ' ms  GB/s':>17}" for m in methods))
    for shape, n, k, m, cells in table:
        line = f"{shape:9}{f'{n}x{k}':>12}{m:>4}  "
        for method in methods:
            ms, nbytes = cells.get(method, (None, None))
            line += f"{'n/a':>17}" if ms is None else f"{ms:9.3f}{nbytes / ms / 1e6:8.1f}"
        print(line)
    print("\ncpu_gguf_dequantize to bfloat16: ms (GB/s of weight bytes)")
    for d in dequant:
        size = f"{d['n']}x{d['k']}"
        print(f"{d['shape']:9}{size:>12}  {d['method']:5}{d['ms']:9.3f}{d['gb_s']:8.1f}")
    if peak:
        print(f"\nint8 peak ({peak['instruction']}, {peak['threads']} threads, int8_peak.c): {peak['gops']:.0f} GOPS; "
              "the x8 kernels at 128 rows:")
        if peak.get("block_scaled_gops"):
            print(f"(and the bound, {peak['block_scaled']} ({', '.join(BOUND_TYPES)}): "
                  f"{peak['block_scaled_gops']:.0f} GOPS, {peak['block_scaled_gops'] / peak['gops']:.1%} of the peak)")
        for r in result["x8_share_of_peak"]:
            of_bound = f" {r['share_of_block_scaled']:6.1%} of the bound" if "share_of_block_scaled" in r else ""
            print(f"{r['shape']:9}{r['method']:>10}{r['gops']:8.0f} GOPS {r['share']:6.1%}{of_bound}")
    print(f"others busy cores before/after: {result['others_busy_cores']}, load {result['load_average']}")


if __name__ == "__main__":
    main()
