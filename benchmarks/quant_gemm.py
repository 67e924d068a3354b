"""Weight-only quantized GEMMs on a GPU (kernels/quant_gemm.py) against bf16 and the weight-read floor. CUDA only.

What it measures (one CUDA device, named in every figure)
    Llama 3.1 8B's linear layers (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) at M rows
    of bfloat16 activations (1 and 16: decode; 64: a decode batch; 2048: a prefill chunk), each layer's four
    products one after another, median of triton.testing.do_bench (L2 flushed before each run):
    - bf16: ``F.linear`` (cuBLAS) on the bf16 weights;
    - W8A16 (int8 per channel), W4A16 (int4 groups of 128; GPTQ / AWQ / compressed-tensors checkpoints are
      stored in this layout), GGUF Q4_K and Q8_0 blocks: the runtime's ``paged_runtime::triton_*_linear`` ops
      as its linear methods call them, so K is split by ``quant_gemm.split_k``'s rule; and each again with
      one split (the "(no split)" rows) to show what splitting K buys.
    The floor of a layer is its weight bytes / the copy bandwidth (a 1 GiB device-to-device copy, bytes read
    and written per second). Weights are random (timings do not depend on the values; GGUF blocks are random
    bytes).

Targets (issue 36): W4A16 at M=1 at most 1.5x its own floor and at least 2.5x faster than bf16; no slower than
bf16 at M=64; at M=2048 (a prefill chunk) at most 1.3x bf16's time.

How to run (on a machine with a CUDA GPU)
    .venv/bin/python benchmarks/quant_gemm.py
    .venv/bin/python benchmarks/quant_gemm.py --rows 1,64 --kinds bf16,w4a16

Prints a table, writes benchmarks/results/quant_gemm-<card>.json and its PNG.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import machine_info, result_path, write_results  # noqa: E402
from benchmarks.kernels import bench_ms, copy_bandwidth  # noqa: E402

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
KINDS = ("bf16", "w8a16", "w4a16", "q4_k", "q8_0")
TARGETS = {"w4a16_m1_vs_floor": 1.5, "w4a16_m1_speedup": 2.5, "w4a16_m64_speedup": 1.0, "w4a16_m2048_vs_bf16": 1.3}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", default="1,16,64,2048", help="M values")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/quant_gemm-<card>.json)")
    return p.parse_args(argv)


def layer_weights(kind: str) -> list[tuple]:
    """Per layer of LAYERS: (weight bytes, the product as fn(x, split) or fn(x) for bf16)."""
    from paged_runtime.kernels import quant_gemm
    from paged_runtime.kernels.gguf_types import row_bytes
    from paged_runtime.layers.quantization.gguf_blocks import SERVED
    from paged_runtime.layers.quantization.int4 import quantize_int4
    from paged_runtime.layers.quantization.int8 import quantize_int8
    out = []
    for n, k in LAYERS.values():
        if kind.startswith("q"):
            qtype = SERVED[kind.upper()]
            raw = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, device="cuda")
            out.append((raw.numel(), lambda x, s=None, raw=raw, t=qtype.id: quant_gemm.gguf_linear(x, raw, t, s)))
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        if kind == "bf16":
            out.append((w.numel() * 2, lambda x, s=None, w=w: F.linear(x, w)))
        elif kind == "w8a16":
            q, scale = quantize_int8(w, torch.bfloat16)
            out.append((q.numel() + scale.numel() * 2,
                        lambda x, s=None, q=q, sc=scale: quant_gemm.w8a16_linear(x, q, sc, s)))
        else:
            q, sz = quantize_int4(w, torch.bfloat16)
            out.append((q.numel() + sz.numel() * sz.element_size(),
                        lambda x, s=None, q=q, sz=sz: quant_gemm.w4a16_linear(x, q, sz, s)))
        del w
    return out


def measure(kinds: list[str], rows: list[int], copy_bw: float) -> list[dict]:
    results = []
    for kind in kinds:
        layers = layer_weights(kind)
        weight_bytes = sum(b for b, _ in layers)
        floor_ms = weight_bytes / copy_bw * 1e3
        for m in rows:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in LAYERS.values()]
            splits = [None] if kind == "bf16" else [None, 1]
            for split in splits:
                ms = bench_ms(lambda: [fn(x, split) for (_, fn), x in zip(layers, xs)])
                results.append({"kind": kind if split is None else f"{kind} (no split)", "rows": m,
                                "weight_bytes": weight_bytes, "ms": ms, "floor_ms": floor_ms, "vs_floor": ms / floor_ms,
                                "weight_gb_s": weight_bytes / (ms / 1e3) / 1e9})
                print(f"{results[-1]['kind']:<18}{m:>6}{ms:>10.3f}{floor_ms:>10.3f}{ms / floor_ms:>9.2f}", flush=True)
        del layers
        torch.cuda.empty_cache()
    bf16 = {r["rows"]: r["ms"] for r in results if r["kind"] == "bf16"}
    for r in results:
        r["vs_bf16_time"] = r["ms"] / bf16[r["rows"]] if r["rows"] in bf16 else None
    return results


def verdicts(results: list[dict]) -> dict:
    w4 = {r["rows"]: r for r in results if r["kind"] == "w4a16"}
    checks = {}
    if 1 in w4:
        checks["w4a16_m1_vs_floor"] = (w4[1]["vs_floor"], "<=")
        if w4[1]["vs_bf16_time"]:
            checks["w4a16_m1_speedup"] = (1 / w4[1]["vs_bf16_time"], ">=")
    if 64 in w4 and w4[64]["vs_bf16_time"]:
        checks["w4a16_m64_speedup"] = (1 / w4[64]["vs_bf16_time"], ">=")
    if 2048 in w4 and w4[2048]["vs_bf16_time"]:
        checks["w4a16_m2048_vs_bf16"] = (w4[2048]["vs_bf16_time"], "<=")
    return {name: {"value": value, "target": f"{op} {TARGETS[name]}",
                   "met": value <= TARGETS[name] if op == "<=" else value >= TARGETS[name]}
            for name, (value, op) in checks.items()}


def draw(plt, results: list[dict], card: str):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind in dict.fromkeys(r["kind"] for r in results):
        mine = [r for r in results if r["kind"] == kind]
        ax.plot([r["rows"] for r in mine], [r["vs_floor"] for r in mine], marker="o", label=kind)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("rows (M)")
    ax.set_ylabel("time / own weight-read floor")
    ax.set_title(f"Llama 3.1 8B linears, one layer, {card}")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/quant_gemm.py measures GPU kernels and needs a CUDA device; none is available here. "
              "(Their correctness tests run on CPU: pytest tests/kernels/test_quant_gemm.py.)", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(f"device: {card}; copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    print(f"{'kind':<18}{'rows':>6}{'ms':>10}{'floor ms':>10}{'x floor':>9}", flush=True)
    results = measure(args.kinds.split(","), [int(m) for m in args.rows.split(",")], copy_bw)
    checks = verdicts(results)
    for name, c in checks.items():
        print(f"{name:<24}{c['value']:>8.2f}   target {c['target']:<8} {'met' if c['met'] else 'NOT met'}")
    record = {"card": card, "machine": machine_info(), "parameters": vars(args) | {"out": str(args.out)},
              "copy_bandwidth_bytes_s": copy_bw, "layers": LAYERS, "results": results, "verdicts": checks}
    print(write_results(args.out or result_path("quant_gemm"), record, draw, results, card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
