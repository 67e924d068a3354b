"""Where a decode step's time goes: torch.profiler over fixed-batch decode steps.

Builds the embedded SmolLM2 (bfloat16; ``--model 1b`` / ``8b``: benchmarks/kernels.py's random-weight Llama
shapes, which a GPU machine can build without the model wheel; or a model folder), prefills ``--batch`` random
prompts of ``--context`` tokens, then times ``--steps`` decode steps and profiles three more. Prints ms/step,
tok/s, the top operators by self CPU time and, on CUDA, per step: the host syncs (stream, device and event
synchronizations: the runner's one sanctioned read is an event wait, so counting stream syncs alone would show
0), the kernels and copies launched, the device's busy time and the rest of the step (the device idle, waiting
on the host: approximate, the profiled steps' busy time from the timed steps' mean); writes benchmarks/results/profile_step-<device>.json (a batch, context or model other than the defaults 128, 300 and
SmolLM2 is named: profile_step-b1-cpu.json, profile_step-b1_c1000-cpu.json, profile_step-1b_b1-h100.json).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/profile_step.py --batch 128 --context 300
    .venv/bin/python benchmarks/profile_step.py --model 1b --batch 1 --context 128     # on a GPU
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import args_dict, result_path, write_results  # noqa: E402
from benchmarks.kernels import LLAMA_CONFIGS, random_llama  # noqa: E402

from paged_runtime import LLM, SamplingParams  # noqa: E402

BATCH, CONTEXT = 128, 300  # the defaults: a result measured at others names them
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", default=None, help="1b / 8b (kernels.py's random Llama shapes) or a folder; "
                                                 "default: the embedded SmolLM2")
    p.add_argument("--model-cache", type=Path, default=Path("/tmp/paged-runtime-random-llama"))
    args = p.parse_args(argv)
    llm = LLM(model=model_folder(args.model, args.model_cache), dtype="bfloat16", max_model_len=2048,
              kv_cache_memory=2 * 2**30, max_num_seqs=256, max_num_batched_tokens=4096)
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
    device = device_per_step(prof, 3) if cuda else {}
    if device:
        device["device_idle_ms"] = step_s * 1000 - device["device_ms"]  # waiting on the host
    print(f"batch {args.batch} x context {args.context}: {step_s * 1000:.1f} ms/step, {args.batch / step_s:.0f} tok/s"
          + (", {syncs:.1f} host syncs, {device_ops:.0f} kernels and copies, device busy {device_ms:.2f} ms, idle "
             "{device_idle_ms:.2f} ms a step".format(**device) if cuda else ""))
    print(f"{'operator':55s} {'ms/step':>9s} {'share':>7s}")
    for r in rows:
        print(f"{r['op'][:55]:55s} {r['self_ms_per_step']:9.1f} {r['share']:7.1%}")
    out = result_path("profile_step", args.model and Path(args.model).name,
                      None if args.batch == BATCH else f"b{args.batch}", None if args.context == CONTEXT else f"c{args.context}")
    print(write_results(out, {"parameters": args_dict(args), "ms_per_step": step_s * 1000,
                              "tok_s": args.batch / step_s, "syncs_per_step": device.get("syncs"),
                              "per_step_on_cuda": device, "top_ops": rows}))
    return 0


def model_folder(model: str | None, cache: Path) -> str | None:
    """None (the embedded default), a random Llama of kernels.py's shapes (built on the GPU once), or a folder."""
    if model in LLAMA_CONFIGS:
        return str(random_llama(model, cache))
    return model


def device_per_step(prof, steps: int) -> dict:
    """Per step of a CUDA profile over ``steps`` steps: host syncs, the device's operations (kernels, graph
    replays' included, and copies) and its busy time (their own time, ms)."""
    on_device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return {"syncs": sum(e.count for e in prof.key_averages() if e.key in SYNC_CALLS) / steps,
            "device_ops": len(on_device) / steps,
            "device_ms": sum(e.self_device_time_total for e in on_device) / steps / 1e3}


if __name__ == "__main__":
    sys.exit(main())
