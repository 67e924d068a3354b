"""Where a decode step's time goes: torch.profiler over fixed-batch decode steps.

Builds the embedded SmolLM2 (bfloat16), prefills ``--batch`` random prompts
of ``--context`` tokens, then times ``--steps`` decode steps and profiles
three more. Prints ms/step, tok/s, the top operators by self CPU time and, on CUDA, the host syncs
per step (stream, device and event synchronizations: the runner's one sanctioned read is an
event wait, so counting stream syncs alone would show 0); writes benchmarks/results/profile_step-<device>.json
(a batch or context other than the defaults 128 and 300 is named: profile_step-b1-cpu.json,
profile_step-b1_c1000-cpu.json).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/profile_step.py --batch 128 --context 300
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import result_path, write_results  # noqa: E402

from paged_runtime import LLM, SamplingParams  # noqa: E402

BATCH, CONTEXT = 128, 300  # the defaults: a result measured at others names them
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    llm = LLM(dtype="bfloat16", max_model_len=2048, kv_cache_memory=2 * 2**30, max_num_seqs=256,
              max_num_batched_tokens=4096)
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(3, 49000) for _ in range(args.context)], params)
    while any(r.num_computed_tokens < args.context for r in engine.core.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    rows = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 3000, "share": e.self_cpu_time_total / total}
            for e in events]
    syncs = sum(e.count for e in prof.key_averages() if e.key in SYNC_CALLS) / 3 if cuda else None
    print(f"batch {args.batch} x context {args.context}: {step_s * 1000:.1f} ms/step, {args.batch / step_s:.0f} tok/s"
          + (f", {syncs:.1f} host syncs/step" if cuda else ""))
    print(f"{'operator':55s} {'ms/step':>9s} {'share':>7s}")
    for r in rows:
        print(f"{r['op'][:55]:55s} {r['self_ms_per_step']:9.1f} {r['share']:7.1%}")
    out = result_path("profile_step", None if args.batch == BATCH else f"b{args.batch}",
                      None if args.context == CONTEXT else f"c{args.context}")
    print(write_results(out, {"parameters": vars(args), "ms_per_step": step_s * 1000, "tok_s": args.batch / step_s,
                              "syncs_per_step": syncs, "top_ops": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
