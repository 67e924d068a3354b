"""Asynchronous scheduling on or off: the same engine settings, measured alternately in one run.

What it measures
    Two engines of the embedded default model (SmolLM2-135M-Instruct) in one process, identical but for
    ``async_scheduling``. Each round runs, on each engine in turn (the first one alternating):

    * the mixed workload (``benchmarks/common.py``, all requests submitted at once, greedy,
      ``ignore_eos``): output tokens per second;
    * batch 1: one request decoding ``--decode-tokens`` tokens: milliseconds per output token.

    Each configuration keeps its best round; ratios are async / sync throughput and sync / async time, so
    > 1 means asynchronous scheduling is faster. Greedy outputs of both engines must be identical (checked).

    On the CPU the forward pass and the host share the same cores: overlapping them buys only what the
    host would otherwise spend alone (scheduling, output processing) and costs thread hand-offs, which is
    why the engine leaves asynchronous scheduling off there by default. On a GPU the host work hides
    behind the device's; measure there with the same script.

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/async_scheduling.py
    .venv/bin/python benchmarks/async_scheduling.py --num-requests 8 --rounds 1 --decode-tokens 16   # smoke

Writes benchmarks/results/async_scheduling-<device>.json (and a PNG if matplotlib is installed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (BUSY_LIMIT, add_round_args, machine_info, others_busy_cores,  # noqa: E402
                               result_path, round_workload, timed_generate, write_results)

MODES = (False, True)


def measure(llm, workload, decode_prompt: list[int], decode_tokens: int) -> dict:
    busy = others_busy_cores()
    seconds, tokens = timed_generate(llm, [r.prompt for r in workload], [r.output_len for r in workload])
    decode_s, decode_out = timed_generate(llm, [decode_prompt], [decode_tokens])
    return {"tok_s": sum(map(len, tokens)) / seconds, "decode_ms_per_token": decode_s * 1e3 / decode_tokens,
            "outputs": tokens + decode_out, "others_busy_cores": busy}


def draw(plt, summary: dict, title: str):
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, label in zip(axes, ("tok_s", "decode_ms_per_token"),
                              ("mixed workload, output tokens / s", "batch 1, ms per token")):
        ax.bar(["sync", "async"], [summary[f"sync_{key}"], summary[f"async_{key}"]], color=["#888", "#36c"])
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_round_args(p, num_requests=32, output_mean=120.0, prompt_mean=160.0, decode_tokens=96, rounds=3)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from paged_runtime import LLM
    out = args.out or result_path("async_scheduling")
    engines = {mode: LLM(model=None, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
                         max_num_seqs=args.num_requests, kv_cache_memory=int(args.kv_cache_gib * 2**30),
                         enable_prefix_caching=False, async_scheduling=mode) for mode in MODES}
    vocab = engines[False].engine.vocab_size
    workload, decode_prompt = round_workload(args, vocab)
    machine = machine_info() | {"dtype": args.dtype, "ops": engines[False].engine.core.ops.name}
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, torch {machine['torch']}, "
          f"{args.dtype}, ops {machine['ops']}; {args.num_requests} requests", flush=True)
    for llm in engines.values():  # warm-up
        timed_generate(llm, [decode_prompt] * 2, [4, 4])
    rounds: dict[bool, list[dict]] = {mode: [] for mode in MODES}
    print(f"{'round':>5} {'mode':>6} {'tok/s':>9} {'ms/token (b=1)':>15}")
    for round_ in range(args.rounds):
        for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
            r = measure(engines[mode], workload, decode_prompt, args.decode_tokens)
            rounds[mode].append(r)
            flag = "  ! others busy" if (r["others_busy_cores"] or 0) > BUSY_LIMIT else ""
            print(f"{round_:>5} {'async' if mode else 'sync':>6} {r['tok_s']:>9.1f} "
                  f"{r['decode_ms_per_token']:>15.2f}{flag}", flush=True)
    identical = all(r["outputs"] == rounds[False][0]["outputs"] for rs in rounds.values() for r in rs)
    summary = {}
    for mode in MODES:
        name = "async" if mode else "sync"
        summary[f"{name}_tok_s"] = max(r["tok_s"] for r in rounds[mode])
        summary[f"{name}_decode_ms_per_token"] = min(r["decode_ms_per_token"] for r in rounds[mode])
    summary["throughput_ratio"] = summary["async_tok_s"] / summary["sync_tok_s"]
    summary["decode_speedup"] = summary["sync_decode_ms_per_token"] / summary["async_decode_ms_per_token"]
    print(f"\nasync / sync: throughput x{summary['throughput_ratio']:.3f}, batch-1 decode x{summary['decode_speedup']:.3f}"
          f"; outputs identical: {identical}")
    for rs in rounds.values():
        for r in rs:
            del r["outputs"]
    result = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
              "outputs_identical": identical, "rounds": {("async" if m else "sync"): rs for m, rs in rounds.items()}}
    title = f"asynchronous scheduling, {machine['cpu_model']} ({args.dtype})"
    print(write_results(out, result, draw, summary, title))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
