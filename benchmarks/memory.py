"""KV-cache memory: paging, sharing and prefix caching, measured on the embedded SmolLM2.

What it measures (one process, bfloat16, the runtime only; no timings but TTFT)
    (a) Paging. A fixed KV budget and a ShareGPT-like workload (the same length
        generator as throughput.py, benchmarks/common.py). After every step: token states held / slots
        in allocated blocks (utilization) and the number of running requests.
        Next to it, what a contiguous engine would fit in the same budget when it
        reserves max_model_len per request, or prompt + max_tokens (an oracle that
        knows each request's length, as in the vLLM paper's "Orca (Oracle)").
    (b) Sharing. Parallel sampling n = 2, 4, 6 (children are forks of the
        prompt) and beam search width 2, 4, 6 (beams are forks): after every
        step, blocks actually held vs the sum of the live sequences' block
        tables (what the same sequences would hold without sharing). Memory
        saved = 1 - held / unshared, averaged over steps. The vLLM paper
        reports 6-30% for parallel sampling and 37-66% for beam search.
    (c) Prefix caching. Time to first token of a request with a 1,000-token
        prefix: cache miss (after reset_prefix_cache) vs hit (the same prefix,
        another suffix). Median of 5 pairs. Target: hit >= 10x faster.
    (d) 8-bit KV cache (--compare-kv-cache-dtypes, instead of a-c): at one
        --kv-cache-memory, the tokens each --kv-cache-dtype holds (auto = bf16,
        fp8, int8; target 2x bf16's), and the time of a decode step of
        --decode-batch requests at --decode-context tokens of context, the three
        engines loaded side by side and timed in turns (so a busy machine slows
        all three alike); median per step, ratio to bf16 (target <= 1.10).
        Writes benchmarks/results/memory-kv_cache_dtype-<device>.json (+ PNG).

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/memory.py [--num-requests 48 --output-mean 128]
        [--kv-cache-dtype fp8]   (a-c with an 8-bit cache)
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/memory.py --compare-kv-cache-dtypes

Prints tables, writes benchmarks/results/memory-<device>.json and memory-<device>.png (if
matplotlib is installed); with an 8-bit --kv-cache-dtype, memory-<kv-cache-dtype>-<device>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (FIRST_ORDINARY_ID, elapsed, machine_info, make_workload,  # noqa: E402
                               result_path, write_results)

from paged_runtime import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from paged_runtime.config import KV_CACHE_DTYPES  # noqa: E402
from paged_runtime.kernels import kv_quant  # noqa: E402

VOCAB = 49152


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-mean", type=float, default=160)
    p.add_argument("--output-mean", type=float, default=128, help="shorter than throughput.py's 340, for time")
    p.add_argument("--kv-blocks", type=int, default=256, help="KV budget for (a), in blocks of 16 tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the cache of (a)-(c); --kv-blocks counts blocks of its own size")
    p.add_argument("--compare-kv-cache-dtypes", action="store_true",
                   help="run (d) only: tokens held and decode step time, auto (bf16) vs fp8 vs int8")
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="(d): bytes for each engine's KV cache")
    p.add_argument("--decode-batch", type=int, default=8, help="(d): requests per decode step")
    p.add_argument("--decode-context", type=int, default=512, help="(d): prompt tokens before the timed steps")
    p.add_argument("--decode-steps", type=int, default=8, help="(d): steps timed per turn")
    p.add_argument("--turns", type=int, default=6, help="(d): turns per engine")
    return p.parse_args(argv)


KV_DTYPE = "auto"  # (a)-(c)'s cache (--kv-cache-dtype)


def block_bytes(kv_cache_dtype: str) -> int:
    """SmolLM2-135M's KV block under bfloat16 activations: 16 tokens x 30 layers x 3 KV heads, each head's K and V
    of 64 (and int8's scales) as the cache stores them (``kv_quant.bytes_per_token_head``)."""
    return 16 * 30 * 3 * kv_quant.bytes_per_token_head(kv_cache_dtype, torch.bfloat16, 64)


def make_llm(max_model_len: int, num_blocks: int, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_dtype", KV_DTYPE)
    return LLM(dtype="bfloat16", max_model_len=max_model_len,
               kv_cache_memory=num_blocks * block_bytes(kwargs["kv_cache_dtype"]), max_num_seqs=256, **kwargs)


def live_stats(llm: LLM) -> tuple[int, int, int, int]:
    """(running requests, token states held, blocks held, blocks if nothing were shared)."""
    core = llm.engine.core
    kv = core.kv_cache
    running = core.scheduler.running
    held = core.num_blocks - kv.num_free_blocks
    unshared = sum(len(kv.tables.get(r.request_id, ())) for r in running)
    return len(running), sum(r.num_computed_tokens for r in running), held, unshared


def drive(llm: LLM, on_step) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        on_step()


# ---- (a) paging ------------------------------------------------------------------
def paging(args) -> dict:
    n = args.num_requests
    work = make_workload(args.seed, n, args.prompt_mean, args.output_mean, 0.8, args.max_model_len, VOCAB)
    llm = make_llm(args.max_model_len, args.kv_blocks, max_num_batched_tokens=2048)
    for i, r in enumerate(work):
        llm.engine.add_request(f"r{i}", r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0,
                                                                 ignore_eos=True))
    samples, saturated = [], []
    scheduler = llm.engine.core.scheduler
    # While requests still wait, the budget (not the workload) limits concurrency: that is the
    # figure to set against a contiguous engine's; the drain at the end is excluded there.
    drive(llm, lambda: (samples.append(live_stats(llm)), scheduler.num_waiting and saturated.append(samples[-1][0])))
    budget_tokens = args.kv_blocks * 16
    busy = [s for s in samples if s[2]]
    utilization = [states / (held * 16) for _, states, held, _ in busy]
    return {
        "budget_tokens": budget_tokens, "requests": n, "steps": len(samples),
        "paged": {"mean_running": statistics.mean(saturated), "max_running": max(s[0] for s in busy),
                  "utilization_mean": statistics.mean(utilization), "utilization_min": min(utilization),
                  "preemptions": llm.engine.core.scheduler.num_preemptions},
        "contiguous_max_model_len": {"max_running": budget_tokens // args.max_model_len},
        "contiguous_oracle": {"max_running": int(budget_tokens // float(np.mean([len(r.prompt) + r.output_len for r in work])))},
    }


# ---- (b) sharing -----------------------------------------------------------------
def sharing(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(FIRST_ORDINARY_ID, VOCAB, 200).tolist()
    rows = {}
    for n in (2, 4, 6):
        llm = make_llm(1024, 512)
        llm.engine.add_request("p", prompt, SamplingParams(n=n, max_tokens=128, temperature=1.0, seed=seed,
                                                           ignore_eos=True))
        rows[f"parallel n={n}"] = _saving(llm, lambda: drive(llm, lambda: None))
    for width in (2, 4, 6):
        llm = make_llm(1024, 512)
        rows[f"beam width={width}"] = _saving(llm, lambda: llm.beam_search(
            [{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=width, max_tokens=128, ignore_eos=True)))
    return rows


def _saving(llm: LLM, run) -> dict:
    samples = []
    core = llm.engine.core
    original = core.step
    core.step = lambda: (original(), samples.append(live_stats(llm)))[0]  # after every step, beams included
    run()
    core.step = original
    busy = [s for s in samples if s[3]]
    saved = [1 - held / unshared for _, _, held, unshared in busy]
    return {"saved_mean": statistics.mean(saved), "saved_max": max(saved), "steps": len(busy)}


# ---- (c) prefix caching ----------------------------------------------------------
def prefix_ttft(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(FIRST_ORDINARY_ID, VOCAB, 1000).tolist()
    llm = make_llm(2048, 512)
    once = SamplingParams(max_tokens=1, temperature=0)
    ttft = lambda prompt: elapsed(lambda: llm.generate([{"prompt_token_ids": prompt}], once, use_tqdm=False))
    ttft(prefix[:50])  # warm up
    misses, hits = [], []
    for i in range(5):
        llm.reset_prefix_cache()
        misses.append(ttft(prefix + [100 + i, 7]))
        hits.append(ttft(prefix + [200 + i, 9]))
    miss, hit = statistics.median(misses), statistics.median(hits)
    return {"prefix_tokens": 1000, "miss_s": miss, "hit_s": hit, "speedup": miss / hit, "target": 10.0}


# ---- (d) 8-bit KV cache ----------------------------------------------------------
KV_COMPARED = ("auto", "fp8", "int8")


def kv_cache_dtypes(args) -> dict:
    """Tokens held at one budget, and decode step time at one batch and context, for each cache dtype."""
    engines = {name: LLM(dtype="bfloat16", kv_cache_dtype=name, max_model_len=args.max_model_len,
                         kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.decode_batch, 8))
               for name in KV_COMPARED}
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(FIRST_ORDINARY_ID, VOCAB, args.decode_context).tolist() for _ in range(args.decode_batch)]
    max_tokens = args.turns * args.decode_steps + 8
    for llm in engines.values():
        _prefill(llm, prompts, max_tokens)
    times = {name: [] for name in KV_COMPARED}
    for _ in range(args.turns):
        for name, llm in engines.items():  # in turns: a busy machine slows every engine alike
            times[name] += [elapsed(llm.engine.step) for _ in range(args.decode_steps)]
    rows = {}
    for name, llm in engines.items():
        core = llm.engine.core
        llm.engine.abort_request([f"d{i}" for i in range(len(prompts))])
        step = statistics.median(times[name])
        rows[name] = {"blocks": core.num_blocks, "tokens_held": core.num_blocks * core.config.block_size,
                      "block_bytes": block_bytes(name), "decode_step_s": step}
    for row in rows.values():
        row["tokens_vs_bf16"] = row["tokens_held"] / rows["auto"]["tokens_held"]
        row["step_vs_bf16"] = row["decode_step_s"] / rows["auto"]["decode_step_s"]
    return {"kv_cache_memory": args.kv_cache_memory, "decode_batch": args.decode_batch,
            "decode_context": args.decode_context, "steps_timed": args.turns * args.decode_steps,
            "attention_backend": engines["auto"].engine.core.executor.worker.attention_backend,
            "targets": {"tokens_vs_bf16": 2.0, "step_vs_bf16": 1.10}, "caches": rows}


def _prefill(llm: LLM, prompts: list[list[int]], max_tokens: int) -> None:
    """Add ``prompts`` (requests d0, d1, ...) and step until each has its first token: every step after this
    one is a decode step of all of them."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    produced = set()
    while len(produced) < len(prompts):
        produced |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}


def report_kv(result: dict) -> None:
    print(f"\n(d) KV cache dtype at kv_cache_memory {result['kv_cache_memory'] >> 20} MiB; decode step of "
          f"{result['decode_batch']} requests at {result['decode_context']} tokens ({result['steps_timed']} steps "
          f"each, {result['attention_backend']} attention)")
    print(f"{'cache':8s} {'block bytes':>12s} {'tokens held':>12s} {'vs bf16':>8s} {'step ms':>9s} {'vs bf16':>8s}")
    for name, row in result["caches"].items():
        print(f"{name:8s} {row['block_bytes']:>12d} {row['tokens_held']:>12d} {row['tokens_vs_bf16']:>7.2f}x"
              f" {row['decode_step_s'] * 1000:>9.1f} {row['step_vs_bf16']:>7.2f}x")


def draw_kv(plt, result: dict):
    rows = result["caches"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    left.bar(list(rows), [r["tokens_vs_bf16"] for r in rows.values()], color="tab:blue")
    left.axhline(2.0, color="gray", linestyle="--", linewidth=1)
    left.set_title("tokens held vs bf16 (same memory)")
    right.bar(list(rows), [r["step_vs_bf16"] for r in rows.values()], color="tab:orange")
    right.axhline(1.10, color="gray", linestyle="--", linewidth=1)
    right.set_title("decode step time vs bf16")
    fig.suptitle("paged-runtime: 8-bit KV cache (SmolLM2-135M, bf16 model)")
    return fig


# ---- report ----------------------------------------------------------------------
def report(result: dict) -> None:
    a = result["paging"]
    print(f"\n(a) paging: KV budget {a['budget_tokens']} tokens, {a['requests']} ShareGPT-like requests")
    print(f"{'engine':34s} {'concurrent requests':>20s} {'KV utilization':>16s}")
    print(f"{'paged (mean while queued / max)':34s} {a['paged']['mean_running']:>10.1f} / {a['paged']['max_running']:<7d}"
          f" {a['paged']['utilization_mean']:>9.1%} (min {a['paged']['utilization_min']:.1%})")
    print(f"{'contiguous, max_model_len each':34s} {a['contiguous_max_model_len']['max_running']:>20d}")
    print(f"{'contiguous, oracle length each':34s} {a['contiguous_oracle']['max_running']:>20d}")
    print("\n(b) sharing: memory saved vs the same sequences without shared blocks")
    for name, row in result["sharing"].items():
        print(f"{name:20s} mean {row['saved_mean']:6.1%}   max {row['saved_max']:6.1%}")
    c = result["prefix"]
    print(f"\n(c) TTFT with a {c['prefix_tokens']}-token prefix: miss {c['miss_s'] * 1000:.1f} ms, "
          f"hit {c['hit_s'] * 1000:.1f} ms -> {c['speedup']:.1f}x (target >= {c['target']:.0f}x)")


def draw(plt, result: dict):
    names = list(result["sharing"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [100 * result["sharing"][n]["saved_mean"] for n in names], color="tab:blue")
    ax.set_ylabel("KV memory saved by sharing (%)")
    ax.set_title("paged-runtime: block sharing (SmolLM2-135M, bf16)")
    ax.tick_params(axis="x", rotation=20)
    return fig


def main(argv=None) -> int:
    global KV_DTYPE
    args = parse_args(argv)
    result = {"machine": machine_info(), "parameters": vars(args)}
    if args.compare_kv_cache_dtypes:
        result |= kv_cache_dtypes(args)
        report_kv(result)
        print("\n" + write_results(result_path("memory", "kv_cache_dtype"), result, draw_kv, result))
        return 0
    KV_DTYPE = args.kv_cache_dtype
    result |= {"paging": paging(args), "sharing": sharing(args.seed), "prefix": prefix_ttft(args.seed)}
    report(result)
    out = result_path("memory", None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype)
    print("\n" + write_results(out, result, draw, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
