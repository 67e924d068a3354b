"""Where the offline workload's time goes on the CPU: a sampling profile of the whole run, by kernel family.

What it measures
    The 128-request ShareGPT-like workload of ``throughput.py`` (same seed, same lengths), all requests
    submitted at once and the engine stepped until idle, with ``perf record`` sampling this process
    (``cpu-clock`` at ``--frequency`` Hz, every thread) during the timed run only. Each sampled function is put
    in one family by its name (``FAMILIES``, first match; the compiled kernels' names come from
    ``kernels/cpu_ops.c``): attention, GGUF linears, dense linears, norms / RoPE / activations, LoRA, the
    OpenMP runtime's waiting (threads spinning or sleeping at a barrier: load imbalance and the serial parts),
    the Python interpreter, the rest of PyTorch, the kernel (page faults: first touches of the KV cache), and
    other. Prints the families' shares and seconds, the top functions, and the run's tok/s (sampling slows
    it a little: compare tok/s with ``throughput.py``, shares here).

    Needs ``perf`` (linux-tools) with permission to sample this process (``perf_event_paranoid`` <= 2 for
    one's own processes); without it the script says so and exits 2.

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/profile_workload.py                 # the default model
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/profile_workload.py --dtype bfloat16 --quantization none

About three minutes for the default 128 requests on 2 cores. Writes
benchmarks/results/profile_workload-cpu.json (a --dtype or --quantization other than the default joins the
name: profile_workload-bfloat16_none-cpu.json) and a PNG.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (args_dict, machine_info, make_workload, others_busy_cores, result_path,  # noqa: E402
                               write_results)

# (family, pattern on "dso symbol"): the first that matches names a sample's family
FAMILIES = (
    ("attention", r"attend_|softmax_unnormalized|flash_attention|kv_gather|store_kv|paged_decode_attention|"
                  r"index_copy"),
    ("linear: GGUF blocks", r"gguf_|x8_"),
    ("linear: dense", r"linear_rows|dot_rows|linear_part|pr_linear|sgemm|gemm|dnnl|mkl_blas|brgemm|jit_"),
    ("norms, RoPE, activations", r"rms_norm|rope|gated_range|silu|gelu|act16"),
    ("LoRA", r"lora_"),
    ("decode step, other", r"pr_decode_layers"),
    ("OpenMP waiting", r"libgomp|libiomp"),
    ("Python", r"libpython|python3"),
    ("PyTorch, other", r"libtorch|libc10"),
    ("OS kernel", r"\[kernel"),
)
OTHER = "other"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="--dtype of the engine (auto: the default's float32)")
    p.add_argument("--quantization", default=None, help="-q of the engine (none: the GGUF dequantized)")
    p.add_argument("--frequency", type=int, default=499, help="samples per second per thread")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--top", type=int, default=15, help="functions listed")
    return p.parse_args(argv)


def family(line: str) -> str:
    return next((name for name, pattern in FAMILIES if re.search(pattern, line)), OTHER)


def perf_rows(data: Path) -> list[tuple[float, str]]:
    """(percent of samples, "dso symbol") of every function ``perf report`` lists for ``data``."""
    text = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio"],
                          capture_output=True, text=True, check=True).stdout
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(.*)$", line)
        if m and not line.lstrip().startswith("#"):
            rows.append((float(m.group(1)), re.sub(r"\s+", " ", m.group(2)).strip()))
    return rows


def run_workload(args, record: Path) -> dict:
    from benchmarks.throughput import sampling
    from paged_runtime import LLM
    kwargs = {} if args.quantization is None else {"quantization": args.quantization}
    llm = LLM(model=None, dtype=args.dtype, max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=2 * 2**30, seed=0, **kwargs)
    vocab = llm.engine.core.runner.model.config.vocab_size
    work = make_workload(0, args.num_requests, 160.0, 340.0, 0.8, 2048, vocab)  # throughput.py's
    llm.generate([[5, 6, 7]], sampling(4))  # warm-up: kernels loaded, first allocations made
    engine, tokens = llm.engine, 0
    busy_before = others_busy_cores()
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.frequency), "-o",
                             str(record), "-p", str(os.getpid())], stdout=subprocess.DEVNULL)
    time.sleep(0.5)  # perf attaches to the threads (a benchmark, not a test: nothing waits on this otherwise)
    start = time.perf_counter()
    for i, r in enumerate(work):
        engine.add_request(f"p{i}", {"prompt_token_ids": r.prompt}, sampling(r.output_len))
    while engine.has_unfinished_requests():
        tokens += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    seconds = time.perf_counter() - start
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=120)
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "others_busy_cores": [busy_before, others_busy_cores()]}


def summarize(rows: list[tuple[float, str]], seconds: float, top: int) -> dict:
    total = sum(p for p, _ in rows) or 1.0
    shares: dict[str, float] = {}
    for p, name in rows:
        shares[family(name)] = shares.get(family(name), 0.0) + p / total
    order = [name for name, _ in FAMILIES] + [OTHER]
    families = [{"family": f, "share": shares[f], "seconds": shares[f] * seconds} for f in order if f in shares]
    return {"families": families,
            "top_functions": [{"function": name, "share": p / total, "family": family(name)} for p, name in rows[:top]]}


def draw(plt, families: list[dict], title: str):
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([f["family"] for f in families][::-1], [100 * f["share"] for f in families][::-1])
    ax.set_xlabel("% of sampled CPU time")
    ax.set_title(title, fontsize=9)
    return fig


def main(argv=None) -> int:
    args = parse_args(argv)
    if shutil.which("perf") is None:
        print("perf is not installed (linux-tools): nothing to sample with")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "perf.data"
        run = run_workload(args, record)
        if not record.is_file():
            print("perf recorded nothing (perf_event_paranoid too strict?)")
            return 2
        profile = summarize(perf_rows(record), run["seconds"], args.top)
    print(f"{args.num_requests} requests, {run['output_tokens']} output tokens in {run['seconds']:.1f} s: "
          f"{run['tok_s']:.1f} tok/s (sampled)")
    print(f"{'family':28s} {'share':>7s} {'seconds':>8s}")
    for f in profile["families"]:
        print(f"{f['family']:28s} {f['share']:7.1%} {f['seconds']:8.1f}")
    print("\ntop functions:")
    for f in profile["top_functions"]:
        print(f"  {f['share']:6.1%}  {f['function'][:100]}  [{f['family']}]")
    qualifier = None if (args.dtype, args.quantization) == ("auto", None) else f"{args.dtype}_{args.quantization}"
    out = result_path("profile_workload", qualifier)
    machine = machine_info()
    title = f"{args.num_requests} requests, dtype {args.dtype}, -q {args.quantization}: {machine['cpu_model']}"
    print(write_results(out, {"parameters": args_dict(args), "machine": machine, "run": run, **profile},
                        draw, profile["families"], title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
