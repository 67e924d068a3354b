"""CPU paged decode attention (``cpu_paged_decode_attention``) against PyTorch's SDPA on contiguous K/V and
the machine's read bandwidth.

What it measures
    SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64), one query token per row over
    its context in blocks of 16 tokens, the blocks scattered at random over the cache as a running engine's
    are, the cache on transparent huge pages as the engine's is (results before 2026-12-07 used 4 KiB pages,
    where 128 x 512 over a float32 cache read ~10% slower). Batch x context: 1 x 512, 1 x 2000 (one long row:
    the threads share it), 4 x 512, 16 x 512, 128 x 512, 16 x 2000. Caches: float32 queries over a bfloat16
    cache, float32, bfloat16. Each call reads a different copy of the cache
    (enough copies for 512 MiB, at most one per layer of the model), so the KV comes from memory, as in a
    decode step, where each layer's cache is read once. Best of ``--repeats`` timings of a pass over the
    copies. The same run measures:
    - ``sdpa``: ``F.scaled_dot_product_attention`` (``enable_gqa``) over the same keys and values laid out
      contiguously ([batch, KV heads, context, dim]: no paging, each row's K/V one stream), the peer;
    - the read floor: GB/s of ``torch.sum`` over 1 GiB on the same threads (what a stream can read).
    GB/s counts the KV bytes each call reads: batch x context x KV heads x dim x 2 x element size.

    ``--prompts``: prompt chunks instead, one request's queries x its context (a whole prompt, or a chunk of
    one after the tokens before it), float32 and bfloat16, the cache in the caches as a chunk's is (its step
    just stored it). Four ways, in the same run:
    - ``flash``: ``cpu_paged_prompt_attention``, the engine's path for chunks of 32 queries or more;
    - ``tiles``: the row kernel, a chunk's rows in tiles of 8 that read each key and value once for all of
      them (the engine's path for shorter chunks, and for all chunks up to 512 keys before ``flash``);
    - ``rows``: the same kernel attending each row alone (``attention_tile_rows(1)``): same bits;
    - ``sdpa``: the torch backend's path for a chunk, which the CPU backend took for longer chunks before
      ``flash``: SDPA (causal) over the prompt's own K/V, or over its context gathered from the paged cache.
    GFLOP/s counts the causal products: 4 x dim x heads x the keys each query sees.

How to run
    .venv/bin/python benchmarks/cpu_attention.py            # about a minute; a quiet machine
    .venv/bin/python benchmarks/cpu_attention.py --isa avx2  # the AVX2 build on an AVX-512 CPU
    .venv/bin/python benchmarks/cpu_attention.py --prompts   # prompt chunks: a few minutes

Writes benchmarks/results/cpu_attention[-prompts][-<isa>]-cpu.json and .png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import machine_info, others_busy_cores, result_path, write_results  # noqa: E402

from paged_runtime.attention.torch_backend import _attend, causal_mask  # noqa: E402
from paged_runtime.config import default_cache_dir  # noqa: E402
from paged_runtime.kernels import cpu, kv_quant  # noqa: E402
from paged_runtime.utils.cpu import huge_page_zeros  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
SHAPES = ((1, 512), (1, 2000), (4, 512), (16, 512), (128, 512), (16, 2000))
CACHES = {"f32 q, bf16 cache": (torch.float32, torch.bfloat16), "float32": (torch.float32, torch.float32),
          "bfloat16": (torch.bfloat16, torch.bfloat16)}
PROMPTS = ((8, 1024), (32, 32), (32, 512), (128, 128), (512, 512), (2048, 2048), (128, 1024), (256, 2048))  # q x ctx
STREAM_BYTES = 512 << 20  # copies cycled through: far more than the last-level cache


def best_ms(fn, copies: list, repeats: int) -> float:
    fn(copies[0])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for c in copies:
            fn(c)
        best = min(best, (time.perf_counter() - start) / len(copies))
    return best * 1e3


def read_floor_gb_s(repeats: int) -> float:
    x = torch.ones(1 << 28)  # 1 GiB of float32
    return x.numel() * 4 / best_ms(torch.sum, [x], repeats) / 1e6


def engine_cache(values: torch.Tensor) -> torch.Tensor:
    """``values`` on transparent huge pages where the platform has them, as the engine allocates its cache
    (``worker/model_runner.py``): scattered blocks over 4 KiB pages read slower (a TLB miss a few blocks)."""
    return huge_page_zeros(tuple(values.shape), values.dtype).copy_(values)


def case(batch: int, context: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, repeats: int,
         gen: torch.Generator) -> dict:
    blocks = batch * -(-context // BLOCK)
    one = blocks * BLOCK * 2 * KV_HEADS * DIM * kv_dtype.itemsize
    n = max(1, min(LAYERS, STREAM_BYTES // one))
    caches = [engine_cache(torch.randn(blocks * BLOCK, 2, KV_HEADS, DIM, generator=gen).to(kv_dtype))
              for _ in range(n)]
    tables = torch.randperm(blocks, generator=gen).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, DIM, generator=gen).to(q_dtype)
    ours = best_ms(lambda kv: cpu.cpu_paged_decode_attention(q, kv, tables, lens, BLOCK, DIM ** -0.5), caches, repeats)
    # the peer: the same keys and values, each row's contiguous, [batch, KV heads, context, dim]
    slots = (tables[:, :, None] * BLOCK + torch.arange(BLOCK)).view(batch, -1)[:, :context]
    contiguous = [(kv[slots][:, :, 0].transpose(1, 2).contiguous(), kv[slots][:, :, 1].transpose(1, 2).contiguous())
                  for kv in caches]
    del caches
    qs = q.to(kv_dtype)[:, :, None]
    sdpa = best_ms(lambda kv: F.scaled_dot_product_attention(qs, kv[0], kv[1], scale=DIM ** -0.5, enable_gqa=True),
                   contiguous, repeats)
    kv_bytes = batch * context * KV_HEADS * DIM * 2 * kv_dtype.itemsize
    return {"batch": batch, "context": context, "copies": n, "kv_bytes": kv_bytes, "ms": ours,
            "gb_s": kv_bytes / ours / 1e6, "sdpa_ms": sdpa, "sdpa_gb_s": kv_bytes / sdpa / 1e6, "vs_sdpa": sdpa / ours}


def prompt_case(queries: int, context: int, dtype: torch.dtype, repeats: int, gen: torch.Generator) -> dict:
    blocks = -(-context // BLOCK)
    cache = engine_cache(torch.randn(blocks * BLOCK, 2, KV_HEADS, DIM, generator=gen).to(dtype))
    table = torch.randperm(blocks, generator=gen)
    tables, lens = table.expand(queries, -1), torch.arange(context - queries + 1, context + 1)
    q = torch.randn(queries, HEADS, DIM, generator=gen).to(dtype)
    slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:context]
    kernel = lambda _: cpu.cpu_paged_decode_attention(q, cache, tables, lens, BLOCK, DIM ** -0.5)  # noqa: E731
    flash = lambda _: cpu.cpu_paged_prompt_attention(q, cache, table, context, BLOCK, DIM ** -0.5)  # noqa: E731
    if queries == context:  # a whole prompt: SDPA over its own K/V, as the engine passes them (no gather)
        k, v = cache[slots, 0].contiguous(), cache[slots, 1].contiguous()
        sdpa = lambda _: _attend(q, k, v, None, DIM ** -0.5)  # noqa: E731
    else:  # a later chunk: its context gathered from the cache, a causal mask
        mask = causal_mask(queries, context, q.device)
        sdpa = lambda _: _attend(q, *kv_quant.gather(cache, None, slots, dtype).unbind(1), mask, DIM ** -0.5)  # noqa: E731
    ms = {"flash": best_ms(flash, [None], repeats)}
    for way, tile_rows in (("tiles", 8), ("rows", 1)):
        cpu.attention_tile_rows(tile_rows)
        ms[way] = best_ms(kernel, [None], repeats)
    cpu.attention_tile_rows(8)
    ms["sdpa"] = best_ms(sdpa, [None], repeats)
    flops = 4 * DIM * HEADS * int(lens.sum())
    return {"queries": queries, "context": context, **{f"{w}_ms": t for w, t in ms.items()},
            **{f"{w}_gflop_s": flops / t / 1e6 for w, t in ms.items()},
            "flash_vs_tiles": ms["tiles"] / ms["flash"], "flash_vs_sdpa": ms["sdpa"] / ms["flash"],
            "tiles_vs_rows": ms["rows"] / ms["tiles"], "tiles_vs_sdpa": ms["sdpa"] / ms["tiles"]}


def run_prompts(args, out) -> None:
    busy_before, gen = others_busy_cores(), torch.Generator().manual_seed(0)
    rows = []
    print(f"{'dtype':10}{'queries x ctx':>15}{'flash ms':>10}{'tiles ms':>10}{'rows ms':>10}{'sdpa ms':>10}"
          f"{'GFLOP/s':>9}{'vs tiles':>9}{'vs sdpa':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for queries, context in PROMPTS:
            r = {"dtype": str(dtype)[6:], **prompt_case(queries, context, dtype, args.repeats, gen)}
            rows.append(r)
            print(f"{r['dtype']:10}{f'{queries}x{context}':>15}{r['flash_ms']:10.3f}{r['tiles_ms']:10.3f}"
                  f"{r['rows_ms']:10.3f}{r['sdpa_ms']:10.3f}{r['flash_gflop_s']:9.1f}{r['flash_vs_tiles']:8.2f}x"
                  f"{r['flash_vs_sdpa']:8.2f}x")
    machine = machine_info()
    result = {"machine": machine, "threads": args.threads, "isa": args.isa or "auto",
              "others_busy_cores": (busy_before, others_busy_cores()), "load_average": os.getloadavg(), "rows": rows}
    title = (f"CPU prompt attention, SmolLM2 shape, one request's chunk; {machine['cpu_model']}, "
             f"{args.threads} threads, kernels {machine['cpu_kernels']['variants']['attention']}")
    print(write_results(out, result, draw_prompts, rows, title, indent=1))


def draw_prompts(plt, rows: list[dict], title: str):
    fig, ax = plt.subplots(figsize=(11, 4.5))
    x = range(len(rows))
    ways = (("flash", "flash kernel (chunks of 32+ queries)"), ("tiles", "row kernel, tiles of 8 rows"),
            ("rows", "row kernel, each row alone"), ("sdpa", "torch SDPA (long chunks before)"))
    for i, (way, label) in enumerate(ways):
        ax.bar([j + (i - 1.5) * 0.2 for j in x], [r[f"{way}_gflop_s"] for r in rows], 0.2, label=label)
    ax.set_xticks(list(x), [f"{r['dtype']}\n{r['queries']}x{r['context']}" for r in rows], fontsize=7)
    ax.set_ylabel("GFLOP/s (causal products)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return fig


def draw(plt, rows: list[dict], floor: float, title: str):
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['cache']}\n{r['batch']}x{r['context']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["gb_s"] for r in rows], 0.4, label="cpu_paged_decode_attention (paged)")
    ax.bar([i + 0.2 for i in x], [r["sdpa_gb_s"] for r in rows], 0.4, label="torch SDPA (contiguous K/V)")
    ax.axhline(floor, color="k", linestyle="--", label=f"read floor {floor:.1f} GB/s")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("KV GB/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default=None, help="--cpu-isa of the kernels (default: auto)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", action="store_true", help="prompt chunks: tiles, rows alone and SDPA")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu.load(default_cache_dir(), args.isa):
        sys.exit("the CPU kernels did not build (no C compiler?)")
    out = args.out or result_path("cpu_attention", "prompts" if args.prompts else None, args.isa, device="cpu")
    if args.prompts:
        return run_prompts(args, out)
    busy_before, gen = others_busy_cores(), torch.Generator().manual_seed(0)
    floor = read_floor_gb_s(args.repeats)
    rows = []
    print(f"{'cache':18}{'batch x ctx':>12}{'ms':>9}{'GB/s':>7}{'floor':>7}{'sdpa ms':>9}{'GB/s':>7}{'vs sdpa':>9}")
    for cache, (q_dtype, kv_dtype) in CACHES.items():
        for batch, context in SHAPES:
            r = {"cache": cache, **case(batch, context, q_dtype, kv_dtype, args.repeats, gen)}
            r["share_of_floor"] = r["gb_s"] / floor
            rows.append(r)
            print(f"{cache:18}{f'{batch}x{context}':>12}{r['ms']:9.3f}{r['gb_s']:7.1f}{r['share_of_floor']:7.0%}"
                  f"{r['sdpa_ms']:9.3f}{r['sdpa_gb_s']:7.1f}{r['vs_sdpa']:8.2f}x")
    machine = machine_info()
    result = {"machine": machine, "threads": args.threads, "isa": args.isa or "auto",
              "others_busy_cores": (busy_before, others_busy_cores()), "load_average": os.getloadavg(),
              "read_floor_gb_s": floor, "rows": rows}
    title = (f"CPU decode attention, SmolLM2 shape, blocks of 16 scattered; {machine['cpu_model']}, "
             f"{args.threads} threads, kernels {machine['cpu_kernels']['variants']['attention']}")
    print(write_results(out, result, draw, rows, floor, title, indent=1))


if __name__ == "__main__":
    main()
