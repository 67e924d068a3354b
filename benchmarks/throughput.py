"""Offline throughput: paged_runtime vs Hugging Face transformers on one mixed-length workload.

What it measures
    A ShareGPT-like workload (fixed seed): prompt and output lengths drawn from
    lognormal distributions (mean prompt ~160 tokens, mean output ~340, long
    tails), capped so prompt + output <= max_model_len. Prompts are random
    token ids from the vocabulary (special ids excluded); every request runs
    greedy with ``ignore_eos`` so it produces exactly its drawn output length.
    In one process, same model (the embedded SmolLM2-135M-Instruct) and dtype:

    1. paged_runtime: all requests submitted at once, the engine stepped until
       it is idle (continuous batching over a paged KV cache);
    2. transformers, one request at a time (``generate``, greedy,
       min_new_tokens = max_new_tokens), on the first ``--hf-sample`` requests;
    3. transformers, static batching: left-padded batches of
       ``--hf-batch-size`` requests, each running until its longest member
       ends; only each request's own output tokens count. First
       ``--hf-batches`` batches only.

    Each system is warmed up with one short generate before it is timed.
    Throughput is output tokens / wall seconds (``time.perf_counter``). The HF
    baselines run on subsets to bound the time, so their tok/s is a rate on a
    different sample of the same workload.

    KV utilization: after every runtime step, token states held (sum of the
    running requests' computed tokens) / slots in allocated blocks; mean and
    min over steps. Next to it, what a contiguous engine reserving
    max_model_len per running sequence would use: states / (running * max_model_len).

    Also reported: how far the runtime's greedy outputs agree with HF's on the
    one-at-a-time subset (in bfloat16, near-tied logits may flip a pick; in
    float32 they match), and the CPU cores other processes kept busy around
    each timed run: torch's thread pool slows down many-fold on shared cores,
    so a flagged row is not comparable (``--threads 1`` is more robust there).

How to run
    make bench          # = HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/throughput.py
    .venv/bin/python benchmarks/throughput.py --num-requests 32 --hf-sample 2 --hf-batches 1
    .venv/bin/python benchmarks/throughput.py --dtype float32 --skip-hf
    # the default model as served (auto), and its weights as plain bfloat16, each against vLLM-CPU (bfloat16)
    .venv/bin/python benchmarks/throughput.py --dtype auto --skip-hf --vllm-python /path/to/vllm-venv/bin/python
    .venv/bin/python benchmarks/throughput.py -q none --skip-hf --vllm-python /path/to/vllm-venv/bin/python

vLLM-CPU (``--vllm-python``: the python of a venv with vllm-cpu installed, see docs/performance.md) runs the
same requests on the same model folder in bfloat16, in a subprocess, after ours: its output tok/s and ours
over it (issue 35's bar: 2x for the default model, 1.5x for its bfloat16 weights).

Defaults (128 requests; HF: 4 one at a time, one static batch of 32) take
about 5 minutes on 2 idle Xeon cores.

Writes benchmarks/results/throughput-<device>.json, throughput-mixed-<device>.json with
``--mixed-sampling`` (a --dtype other than bfloat16 joins the qualifier: throughput-float32-cpu.json,
throughput-mixed_float32-cpu.json; -q joins it as q<method>: throughput-auto-cpu.json, throughput-qnone-cpu.json),
and a PNG if matplotlib is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (BUSY_LIMIT, FIRST_ORDINARY_ID, Request, args_dict, describe,  # noqa: E402
                               machine_info, make_workload, others_busy_cores, result_path, write_results)

# vs_vllm_cpu: issue 35's bar for the default model, its GGUF blocks; its weights dequantized (-q none) have 1.5x
TARGETS = {"vs_hf_single": 30.0, "vs_hf_static": 3.0, "output_tok_s": 600.0, "kv_utilization": 0.97,
           "mixed_vs_greedy": 0.9, "vs_vllm_cpu": 2.0}
DEQUANTIZED_VS_VLLM_CPU = 1.5


@dataclass
class Result:
    system: str
    requests: int
    output_tokens: int
    seconds: float
    # CPU cores busy with other work just before and just after this run (see others_busy_cores).
    others_busy_cores: tuple[float | None, float | None] = (None, None)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- arguments and workload -------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128, help="requests for the runtime run")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "auto"],
                   help="auto: the default model's own choice (its GGUF blocks in float32 activations)")
    p.add_argument("--quantization", "-q", default=None,
                   help="none: the GGUF's weights dequantized (a plain bfloat16 / float32 model); default: its blocks")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the engine's --kv-cache-dtype (auto: the activations' dtype; bfloat16 under float32 "
                        "activations: half the bytes)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--prompt-mean", type=float, default=160.0)
    p.add_argument("--output-mean", type=float, default=340.0)
    p.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of both lengths")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--hf-sample", type=int, default=4, help="requests run one at a time by transformers")
    p.add_argument("--hf-batch-size", type=int, default=32, help="requests per transformers static batch")
    p.add_argument("--hf-batches", type=int, default=1, help="static batches to run")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for every system; 0 leaves torch's default (one per core)")
    p.add_argument("--skip-hf", action="store_true", help="runtime only")
    p.add_argument("--mixed-sampling", action="store_true",
                   help="also run the workload with mixed sampling params and compare with greedy")
    p.add_argument("--vllm-python", help="the python of a venv with vllm-cpu installed: vLLM (bfloat16, same "
                   "model folder, same requests) as the peer in the same run")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default results/throughput[-mixed]-<device>.json)")
    return p.parse_args(argv)


def workload_summary(work: list[Request]) -> dict:
    p = np.array([len(r.prompt) for r in work])
    o = np.array([r.output_len for r in work])
    stats = lambda a: describe(a) | {"max": int(a.max()), "total": int(a.sum())}  # noqa: E731
    return {"requests": len(work), "prompt_len": stats(p), "output_len": stats(o)}


# ---- paged_runtime --------------------------------------------------------------
def make_llm(args: argparse.Namespace):
    from paged_runtime import LLM
    extra = {} if args.quantization is None else {"quantization": args.quantization}
    return LLM(model=None, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=int(args.kv_cache_gib * 2**30),
               kv_cache_dtype=args.kv_cache_dtype, seed=0, **extra)


def sampling(output_len: int, index: int = 0, mixed: bool = False):
    """Greedy; or, with ``mixed``, by thirds: greedy / top_p 0.9 at T 0.8 with penalties / top_k 20
    with 5 logprobs (the sampler issue's mix)."""
    from paged_runtime import SamplingParams
    kind = index % 3 if mixed else 0
    if kind == 1:
        return SamplingParams(max_tokens=output_len, temperature=0.8, top_p=0.9, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.1, seed=index, ignore_eos=True)
    if kind == 2:
        return SamplingParams(max_tokens=output_len, temperature=1.0, top_k=20, logprobs=5, seed=index,
                              ignore_eos=True)
    return SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)


class KVTracker:
    """Per-step KV utilization: held token states over allocated slots (paged) and over max-length reservations."""

    def __init__(self, core) -> None:
        self.core = core
        self.paged: list[float] = []
        self.contiguous: list[float] = []

    def sample(self) -> None:
        core = self.core
        running = core.scheduler.running
        states = sum(r.num_computed_tokens for r in running)
        slots = (core.num_blocks - core.kv_cache.num_free_blocks) * core.config.block_size
        if slots:
            self.paged.append(states / slots)
        if running:
            self.contiguous.append(states / (len(running) * core.max_model_len))

    def summary(self) -> dict:
        mean_min = lambda xs: {"mean": float(np.mean(xs)), "min": float(np.min(xs))} if xs else None  # noqa: E731
        return {"steps": len(self.paged), "paged": mean_min(self.paged), "contiguous": mean_min(self.contiguous)}


def run_runtime(llm, work: list[Request], mixed: bool = False) -> tuple[Result, dict, list[list[int]]]:
    """All requests submitted at once, engine stepped until idle. Returns result, KV stats, output token ids."""
    engine, core = llm.engine, llm.engine.core
    preempted_before = core.scheduler.num_preemptions
    tracker = KVTracker(core)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, r in enumerate(work):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": r.prompt}, sampling(r.output_len, i, mixed))
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        tracker.sample()
        steps += 1
    seconds = time.perf_counter() - start
    ordered = [list(outputs[f"bench-{i}"]) for i in range(len(work))]
    if [len(o) for o in ordered] != [r.output_len for r in work]:
        raise RuntimeError("runtime produced output lengths other than requested")
    kv = tracker.summary() | {"engine_steps": steps, "num_blocks": core.num_blocks,
                              "block_size": core.config.block_size,
                              "preemptions": core.scheduler.num_preemptions - preempted_before}
    name = "paged_runtime (mixed sampling)" if mixed else "paged_runtime"
    return Result(name, len(work), sum(map(len, ordered)), seconds), kv, ordered


def warm_up_runtime(llm, vocab_size: int) -> None:
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(FIRST_ORDINARY_ID, vocab_size, 32).tolist()} for _ in range(4)]
    llm.generate(prompts, [sampling(8)] * 4, use_tqdm=False)


# ---- transformers ------------------------------------------------------------------
def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from paged_runtime.models.default_model import default_model_path
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=getattr(torch, dtype))
    return model.eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    """Greedy, exactly ``new_tokens`` new tokens per row; prompts left-padded. Returns the new tokens."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad_id)
    return out[:, width:]


def run_hf_single(model, work: list[Request], pad_id: int) -> tuple[Result, list[list[int]]]:
    outputs = []
    start = time.perf_counter()
    for r in work:
        outputs.append(hf_generate(model, [r.prompt], r.output_len, pad_id)[0].tolist())
    seconds = time.perf_counter() - start
    return Result("HF one-at-a-time", len(work), sum(r.output_len for r in work), seconds), outputs


def run_hf_static(model, work: list[Request], batch_size: int, pad_id: int) -> Result:
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        hf_generate(model, [r.prompt for r in batch], max(r.output_len for r in batch), pad_id)
    seconds = time.perf_counter() - start
    return Result(f"HF static batch={batch_size}", len(work), sum(r.output_len for r in work), seconds)


def warm_up_hf(model, pad_id: int) -> None:
    hf_generate(model, [[FIRST_ORDINARY_ID + 7] * 32] * 2, 8, pad_id)


def greedy_agreement(runtime_outputs: list[list[int]], hf_outputs: list[list[int]]) -> list[dict]:
    """Per request: tokens until the first difference between runtime and HF greedy outputs."""
    rows = []
    for a, b in zip(runtime_outputs, hf_outputs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append({"output_len": len(a), "matching_prefix": same})
    return rows


# ---- reporting -----------------------------------------------------------------------
def timed(run, *args):
    """Runs ``run(*args)`` (whose first return value is a Result) between two idle CPU samples."""
    before = others_busy_cores()
    out = run(*args)
    result = out[0] if isinstance(out, tuple) else out
    result.others_busy_cores = (before, others_busy_cores())
    return out


# ---- vLLM-CPU, the peer ----------------------------------------------------------
# Run by vLLM's python: argv = model folder, workload JSON ([[prompt ids, output len], ...]), max_model_len,
# max_num_seqs, max_num_batched_tokens. Greedy, ignore_eos, every request at once; one warm-up generate first.
VLLM_PEER = """
import json, sys, time
from vllm import LLM, SamplingParams
model, work = sys.argv[1], json.load(open(sys.argv[2]))
llm = LLM(model=model, dtype="bfloat16", max_model_len=int(sys.argv[3]), max_num_seqs=int(sys.argv[4]),
          max_num_batched_tokens=int(sys.argv[5]), seed=0)
llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
start = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}))
"""


def run_vllm(python: str, work: list[Request], args) -> Result:
    """vLLM's own CPU build on the same folder and requests, in a subprocess of its venv (its KV cache: the
    same --kv-cache-gib, through VLLM_CPU_KVCACHE_SPACE)."""
    import subprocess
    import tempfile

    from paged_runtime.models.default_model import default_model_path
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump([[r.prompt, r.output_len] for r in work], f)
        f.flush()
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(args.kv_cache_gib)))}
        run = subprocess.run([python, "-c", VLLM_PEER, str(default_model_path()), f.name, str(args.max_model_len),
                              str(args.max_num_seqs), str(args.max_num_batched_tokens)],
                             capture_output=True, text=True, timeout=7200, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not lines:
        raise RuntimeError(f"vLLM failed: {(run.stderr or run.stdout)[-2000:]}")
    got = json.loads(lines[-1].removeprefix("RESULT "))
    return Result("vLLM-CPU (bfloat16)", len(work), got["output_tokens"], got["seconds"])


def print_table(results: list[Result]) -> None:
    base = results[0].tok_s
    header = f"{'system':<24}{'requests':>9}{'out tokens':>12}{'seconds':>10}{'out tok/s':>11}{'vs runtime':>12}"
    print(header)
    print("-" * len(header))
    for r in results:
        busy = [b for b in r.others_busy_cores if b is not None]
        flag = f"  ! other work kept {max(busy):.1f} cores busy" if busy and max(busy) > BUSY_LIMIT else ""
        print(f"{r.system:<24}{r.requests:>9}{r.output_tokens:>12}{r.seconds:>10.1f}{r.tok_s:>11.1f}"
              f"{r.tok_s / base:>11.3f}x{flag}")


def verdicts(results: list[Result], kv: dict, quantization: str | None) -> dict:
    runtime = results[0]
    figures = {"output_tok_s": runtime.tok_s, "kv_utilization": kv["paged"]["mean"] if kv["paged"] else None}
    for r in results[1:]:
        if r.system.startswith("vLLM"):
            figures["vs_vllm_cpu"] = runtime.tok_s / r.tok_s
        elif r.system.startswith("HF"):
            key = "vs_hf_single" if r.system.startswith("HF one") else "vs_hf_static"
            figures[key] = runtime.tok_s / r.tok_s
        else:  # the mixed-sampling run: its throughput relative to greedy
            figures["mixed_vs_greedy"] = r.tok_s / runtime.tok_s
    targets = TARGETS | ({"vs_vllm_cpu": DEQUANTIZED_VS_VLLM_CPU} if quantization == "none" else {})
    return {k: {"value": v, "target": targets[k], "met": v is not None and v >= targets[k]}
            for k, v in figures.items()}


def print_summary(checks: dict, kv: dict) -> None:
    labels = {"vs_hf_single": "runtime / HF one-at-a-time", "vs_hf_static": "runtime / HF static batching",
              "vs_vllm_cpu": "runtime / vLLM-CPU bfloat16",
              "output_tok_s": "runtime output tok/s", "kv_utilization": "KV utilization (mean)",
              "mixed_vs_greedy": "mixed sampling / greedy"}
    print()
    for key in ("vs_hf_single", "vs_hf_static", "vs_vllm_cpu", "output_tok_s", "kv_utilization", "mixed_vs_greedy"):
        if key not in checks:
            continue
        c = checks[key]
        unit = "x" if key.startswith("vs") else ""
        value, target = (f"{c['value']:.1%}", f"{c['target']:.0%}") if key in ("kv_utilization", "mixed_vs_greedy") else \
            (f"{c['value']:.1f}{unit}", f"{c['target']:g}{unit}")
        print(f"{labels[key]:<30}{value:>10}   target >= {target:<6} {'met' if c['met'] else 'NOT met'}")
    paged, contiguous = kv["paged"], kv["contiguous"]
    if paged:
        print(f"KV utilization over {kv['steps']} steps: paged mean {paged['mean']:.1%}, min {paged['min']:.1%}; "
              f"contiguous max_model_len reservation mean {contiguous['mean']:.1%}, min {contiguous['min']:.1%}; "
              f"preemptions {kv['preemptions']}")


def draw(plt, results: list[Result], title: str):
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r.system for r in results][::-1], [r.tok_s for r in results][::-1])
    ax.set_xlabel("output tokens / s")
    ax.set_title(title)
    return fig


# ---- main ----------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    busy = others_busy_cores()
    if busy is not None and busy > BUSY_LIMIT:
        print(f"warning: other processes keep {busy:.1f} of {os.cpu_count()} cores busy; torch's thread pool "
              "slows down many-fold when cores are shared, so figures will be distorted", flush=True)
    llm = make_llm(args)
    vocab = llm.engine.core.runner.model.config.vocab_size
    work = make_workload(args.seed, args.num_requests, args.prompt_mean, args.output_mean, args.sigma,
                         args.max_model_len, vocab)
    print(f"workload: {json.dumps(workload_summary(work))}", flush=True)

    warm_up_runtime(llm, vocab)
    runtime, kv, runtime_outs = timed(run_runtime, llm, work)
    results = [runtime]
    print(f"paged_runtime: {runtime.output_tokens} tokens in {runtime.seconds:.1f}s", flush=True)

    if args.mixed_sampling:
        mixed, _, _ = timed(run_runtime, llm, work, True)
        results.append(mixed)
        print(f"paged_runtime, mixed sampling: {mixed.tok_s:.1f} tok/s = {mixed.tok_s / runtime.tok_s:.2f}x greedy "
              "(target: within 10%)", flush=True)

    if args.vllm_python:
        peer = timed(run_vllm, args.vllm_python, work, args)
        results.append(peer)
        print(f"vLLM-CPU: {peer.output_tokens} tokens in {peer.seconds:.1f}s", flush=True)

    agreement = None
    if not args.skip_hf:
        model = load_hf("float32" if args.dtype == "auto" else args.dtype)
        pad_id = llm.get_tokenizer().pad_token_id or 0
        warm_up_hf(model, pad_id)
        single, hf_outs = timed(run_hf_single, model, work[:args.hf_sample], pad_id)
        print(f"HF one-at-a-time: {single.output_tokens} tokens in {single.seconds:.1f}s", flush=True)
        static_work = work[:args.hf_batch_size * args.hf_batches]
        static = timed(run_hf_static, model, static_work, args.hf_batch_size, pad_id)
        print(f"HF static: {static.output_tokens} tokens in {static.seconds:.1f}s", flush=True)
        results += [single, static]
        agreement = greedy_agreement(runtime_outs, hf_outs)

    print()
    print_table(results)
    checks = verdicts(results, kv, args.quantization)
    print_summary(checks, kv)
    if agreement:
        print("greedy agreement runtime vs HF (matching prefix / output len): "
              + ", ".join(f"{a['matching_prefix']}/{a['output_len']}" for a in agreement))

    out = args.out or result_path("throughput", "mixed" if args.mixed_sampling else None,
                                  None if args.dtype == "bfloat16" else args.dtype,
                                  None if args.quantization is None else f"q{args.quantization}",
                                  None if args.kv_cache_dtype == "auto" else f"kv{args.kv_cache_dtype}")
    params = args_dict(args)
    report = {"machine": machine_info(), "parameters": params, "workload": workload_summary(work),
              "hf_static_workload": workload_summary(work[:args.hf_batch_size * args.hf_batches]),
              "results": [vars(r) | {"output_tok_s": r.tok_s, "vs_runtime": r.tok_s / runtime.tok_s}
                          for r in results],
              "kv_cache": kv, "targets": checks, "greedy_agreement": agreement,
              "wall_seconds": time.perf_counter() - started}
    print("\n" + write_results(out, report, draw, results, out.stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
