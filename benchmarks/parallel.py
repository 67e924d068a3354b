"""Tensor and pipeline parallelism on the CPU: step time, throughput and communication per step, by layout.

What it measures
    One engine per layout, all alive in one process, measured in turn (the order rotates each round):

    * ``tp1``      one rank in the engine's process (the default for one device): the baseline;
    * ``tp1-1t``   the same engine on one thread: what one core of the two does alone (each rank of
      ``tp2`` computes on one thread; on shared cores a one-thread rank is also spared torch's thread pool
      stalling when one of its threads is descheduled);
    * ``tp1-mp``   one rank in a worker process (``distributed_executor_backend="mp"``): what the pipes cost;
    * ``tp2``      tensor parallel over two worker processes (gloo);
    * ``pp2``      two pipeline stages (15 layers each);
    * ``tp2xpp2``  both: four worker processes.

    Each round runs, on each engine, the mixed workload (``benchmarks/common.py``, all requests submitted at
    once, greedy, ``ignore_eos``: output tokens per second, and the mean time of one engine step, the
    executor's ``execute``) and batch 1 (one request decoding ``--decode-tokens`` tokens: milliseconds per
    output token). Each layout keeps its best round; ratios are against ``tp1`` of the same run (> 1: faster).

Communication per step
    Computed from the model's shape for every step the run took (``paged_runtime/utils/comm_volume.py``: two
    all-reduces of tokens x hidden per decoder layer and one for the embedding, the LM head's all-gather of
    sampled rows x vocabulary shard, the pipeline's send of 2 x tokens x hidden), summed over all ranks, in
    payload bytes (what each rank hands to the call). Not measured here: ``tests/unit/test_comm_volume.py``
    checks the formulas against the collectives a real step calls, counted. Measured: the pipes' bytes,
    each step's pickled call to every rank and the driver's pickled answer (0 in-process).

The model
    A random-weight Llama the size of the embedded SmolLM2-135M (hidden 576, MLP 1536, 30 layers, tied
    vocabulary of 49152, head dim 64) but with 8 attention heads and 4 KV heads instead of 9 and 3: SmolLM2
    splits over 1, 3 or 9 ranks only (``check_parallel``), and three ranks on two cores would measure
    oversubscription. The q/k/v/o matrices hold the same number of weights (576 x (512 + 2 x 256 + 512) =
    576 x (576 + 2 x 192 + 576)), so a step costs the same; random weights are fine for timing and every
    request runs ``ignore_eos``. ``--model`` measures another folder (e.g. SmolLM2 with ``--layouts
    tp1,pp2``).

What two ranks on this CPU mean
    A worker process gets cores / ranks threads: at tp2 each rank computes half of every matrix product on
    one core, where tp1 computes all of it on two threads. The arithmetic is the same, so tensor
    parallelism cannot win here; what it shows is the price of its collectives (61 all-reduces per step
    through gloo over loopback, each a synchronisation of two processes) and of the pipes. Pipeline stages
    without micro-batches run one after the other: pp2 leaves one core idle at any time. On a machine with
    one accelerator per rank the same script measures what the split buys.

    Next to other work the picture turns over: the kernel shares the cores per thread, so four
    single-threaded ranks get more of them than one process, and torch's two-thread pool in ``tp1`` stalls
    whenever one of its threads is descheduled. ``others_busy_cores`` (sampled before each run, rows flagged
    above 0.3) says whether a figure is of this kind.

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/parallel.py
    .venv/bin/python benchmarks/parallel.py --num-requests 4 --decode-tokens 8 --rounds 1 --layouts tp1,tp2   # smoke

Writes benchmarks/results/parallel-<device>.json (and a PNG if matplotlib is installed).
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (BUSY_LIMIT, add_round_args, copy_tokenizer, machine_info,  # noqa: E402
                               others_busy_cores, result_path, round_workload, timed_generate, write_results)

from paged_runtime.utils.comm_volume import KINDS, step_bytes  # noqa: E402


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    pp: int
    backend: str | None  # None: one rank in the engine's process
    threads: int | None = None  # the in-process rank's torch threads (None: torch's default, all cores)


LAYOUTS = {layout.name: layout for layout in (Layout("tp1", 1, 1, None), Layout("tp1-1t", 1, 1, None, 1),
                                               Layout("tp1-mp", 1, 1, "mp"),
                                               Layout("tp2", 2, 1, "mp"), Layout("pp2", 1, 2, "mp"),
                                               Layout("tp2xpp2", 2, 2, "mp"))}


def make_model(folder: Path, dtype: torch.dtype) -> Path:
    """A random Llama of SmolLM2-135M's size whose heads split over 2 (and 4) ranks, with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return folder


class StepRecorder:
    """Wraps the engine's ``executor.execute``: each step's time, its scheduler output and the answer."""

    def __init__(self, executor) -> None:
        self.steps: list[tuple[float, object, object]] = []
        self.execute = executor.execute
        executor.execute = self

    def __call__(self, out):
        start = time.perf_counter()
        result = self.execute(out)
        self.steps.append((time.perf_counter() - start, out, result))
        return result

    def take(self) -> list[tuple[float, object, object]]:
        steps, self.steps = self.steps, []
        return steps


def step_stats(steps, model, layout: Layout, dtype_bytes: int) -> dict:
    """Mean step time, tokens, collective payload and pipe bytes per step."""
    comm = dict.fromkeys(KINDS, 0)
    pipes = 0
    for _, out, result in steps:
        num_tokens = sum(s.num_scheduled for s in out.scheduled)
        for kind, n in step_bytes(model, layout.tp, layout.pp, num_tokens, sum(s.samples for s in out.scheduled),
                                  dtype_bytes).items():
            comm[kind] += n
        if layout.backend is not None:  # one pickled call to every rank, one answer from each
            call = pickle.dumps(("execute", (out,)), protocol=pickle.HIGHEST_PROTOCOL)
            pipes += layout.tp * layout.pp * len(call) + len(pickle.dumps(("ok", result)))
    n = len(steps)
    return {"steps": n, "step_ms": statistics.fmean(t for t, _, _ in steps) * 1e3,
            "tokens_per_step": sum(sum(s.num_scheduled for s in out.scheduled) for _, out, _ in steps) / n,
            "comm_bytes_per_step": {kind: v / n for kind, v in comm.items() if kind != "recv"},
            "pipe_bytes_per_step": pipes / n}


def threads_per_rank(layout: Layout) -> int:
    """A worker process takes its share of the cores (executor/multiproc.py); the in-process rank its own."""
    if layout.backend is None:
        return layout.threads or torch.get_num_threads()
    return max(1, len(os.sched_getaffinity(0)) // (layout.tp * layout.pp))


def measure(llm, recorder: StepRecorder, layout: Layout, model, dtype_bytes: int, workload,
            decode_prompt: list[int], decode_tokens: int) -> dict:
    busy = others_busy_cores()
    threads = torch.get_num_threads()
    if layout.threads:
        torch.set_num_threads(layout.threads)
    try:
        return _measure(llm, recorder, layout, model, dtype_bytes, workload, decode_prompt, decode_tokens) | {
            "others_busy_cores": busy}
    finally:
        torch.set_num_threads(threads)


def _measure(llm, recorder: StepRecorder, layout: Layout, model, dtype_bytes: int, workload,
             decode_prompt: list[int], decode_tokens: int) -> dict:
    recorder.take()
    seconds, tokens = timed_generate(llm, [r.prompt for r in workload], [r.output_len for r in workload])
    mixed = step_stats(recorder.take(), model, layout, dtype_bytes)
    decode_s, decode_out = timed_generate(llm, [decode_prompt], [decode_tokens])
    decode = step_stats(recorder.take()[1:], model, layout, dtype_bytes)  # the decode steps (not the prompt's)
    return {"tok_s": sum(map(len, tokens)) / seconds, "decode_ms_per_token": decode_s * 1e3 / decode_tokens,
            "mixed": mixed, "decode": decode, "outputs": tokens + decode_out}


def summarize(layouts: list[Layout], rounds: dict[str, list[dict]]) -> dict:
    base = rounds["tp1"] if "tp1" in rounds else rounds[layouts[0].name]
    base_tok_s = max(r["tok_s"] for r in base)
    base_ms = min(r["decode_ms_per_token"] for r in base)
    summary = {}
    for layout in layouts:
        rs = rounds[layout.name]
        best = max(rs, key=lambda r: r["tok_s"])
        fastest = min(rs, key=lambda r: r["decode_ms_per_token"])
        tok_s, ms = best["tok_s"], fastest["decode_ms_per_token"]
        summary[layout.name] = {
            "tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp,
            "executor": "in-process" if layout.backend is None else layout.backend, "tok_s": tok_s,
            "throughput_ratio": tok_s / base_tok_s, "decode_ms_per_token": ms, "decode_speedup": base_ms / ms,
            "mixed_step_ms": best["mixed"]["step_ms"], "mixed_steps": best["mixed"]["steps"],
            "mixed_tokens_per_step": best["mixed"]["tokens_per_step"],
            "mixed_comm_bytes_per_step": best["mixed"]["comm_bytes_per_step"],
            "mixed_pipe_bytes_per_step": best["mixed"]["pipe_bytes_per_step"],
            "decode_step_ms": min(r["decode"]["step_ms"] for r in rs),
            "decode_comm_bytes_per_step": best["decode"]["comm_bytes_per_step"],
            "decode_pipe_bytes_per_step": best["decode"]["pipe_bytes_per_step"],
            "others_busy_cores": max(r["others_busy_cores"] or 0 for r in (best, fastest))}  # of the rounds kept
    return summary


def print_table(summary: dict) -> None:
    print(f"\n{'layout':>9} {'ranks':>5} {'tok/s':>7} {'x tp1':>6} {'ms/tok b=1':>10} {'x tp1':>6} "
          f"{'ms/step':>8} {'ms/step b=1':>11} {'MB coll/step':>12} {'KB coll/step b=1':>16} {'KB pipes/step':>13}")
    for name, s in summary.items():
        ranks = s["tensor_parallel_size"] * s["pipeline_parallel_size"]
        print(f"{name:>9} {ranks:>5} {s['tok_s']:>7.1f} {s['throughput_ratio']:>6.2f} "
              f"{s['decode_ms_per_token']:>10.1f} {s['decode_speedup']:>6.2f} {s['mixed_step_ms']:>8.1f} "
              f"{s['decode_step_ms']:>11.1f} {sum(s['mixed_comm_bytes_per_step'].values()) / 1e6:>12.2f} "
              f"{sum(s['decode_comm_bytes_per_step'].values()) / 1e3:>16.1f} "
              f"{s['mixed_pipe_bytes_per_step'] / 1e3:>13.1f}")
    print("ms/step: mean engine step (the executor's execute) of the mixed workload / of batch-1 decoding; coll: "
          "all-reduce + all-gather + send payload, all ranks together (paged_runtime/utils/comm_volume.py); "
          "pipes: pickled calls and answers (measured)")


def draw(plt, summary: dict, title: str):
    names = list(summary)
    colors = ["#888"] + ["#36c"] * (len(names) - 1)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    panels = (("tok_s", "mixed workload, output tokens / s"), ("decode_ms_per_token", "batch 1, ms per token"))
    for ax, (key, label) in zip(axes, panels):
        ax.bar(names, [summary[n][key] for n in names], color=colors)
        ax.set_title(label, fontsize=9)
    bottom = [0.0] * len(names)
    for kind, color in zip(("all_reduce", "all_gather", "send"), ("#36c", "#c63", "#393")):
        values = [summary[n]["mixed_comm_bytes_per_step"][kind] / 1e6 for n in names]
        axes[2].bar(names, values, bottom=bottom, color=color, label=kind.replace("_", "-"))
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[2].set_title("mixed workload, collective MB per step (all ranks)", fontsize=9)
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: a random SmolLM2-sized Llama)")
    add_round_args(p, num_requests=16, output_mean=24.0, prompt_mean=64.0, decode_tokens=24, rounds=2)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=float, default=0.25, help="per rank")
    p.add_argument("--note", default=None, help="recorded in the JSON (e.g. what else ran on the machine)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    layouts = [LAYOUTS[name] for name in args.layouts.split(",")]
    from paged_runtime import LLM
    from paged_runtime.models.config import ModelConfig
    out = args.out or result_path("parallel")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="parallel-bench-") as tmp:
        folder = args.model or make_model(Path(tmp), dtype)
        model = ModelConfig.from_folder(folder)
        engines, startup = {}, {}
        for layout in layouts:
            start = time.perf_counter()
            engines[layout.name] = LLM(model=str(folder), dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
                                       max_num_seqs=args.num_requests, kv_cache_memory=int(args.kv_cache_gib * 2**30),
                                       enable_prefix_caching=False, tensor_parallel_size=layout.tp,
                                       pipeline_parallel_size=layout.pp, distributed_executor_backend=layout.backend)
            startup[layout.name] = time.perf_counter() - start
            print(f"{layout.name}: engine up in {startup[layout.name]:.1f} s", flush=True)
        try:
            return run(args, layouts, engines, startup, model, folder, out)
        finally:
            for llm in engines.values():
                llm.engine.core.shutdown()


def run(args, layouts: list[Layout], engines: dict, startup: dict, model, folder: Path, out: Path) -> int:
    recorders = {name: StepRecorder(llm.engine.core.executor) for name, llm in engines.items()}
    first = engines[layouts[0].name]
    vocab = first.engine.vocab_size
    workload, decode_prompt = round_workload(args, vocab)
    dtype_bytes = getattr(torch, args.dtype).itemsize
    machine = machine_info() | {"dtype": args.dtype, "note": args.note}
    model_info = {"folder": "random SmolLM2-sized Llama" if args.model is None else str(folder),
                  "num_layers": model.num_layers, "hidden_size": model.hidden_size, "num_heads": model.num_heads,
                  "num_kv_heads": model.num_kv_heads, "intermediate_size": model.intermediate_size,
                  "vocab_size": model.vocab_size}
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, torch {machine['torch']}, {args.dtype}; "
          f"{args.num_requests} requests; model {model_info}", flush=True)
    for llm in engines.values():  # warm-up
        timed_generate(llm, [decode_prompt] * 2, [4, 4])
    rounds: dict[str, list[dict]] = {layout.name: [] for layout in layouts}
    print(f"{'round':>5} {'layout':>9} {'tok/s':>9} {'ms/token (b=1)':>15}")
    for round_ in range(args.rounds):
        shift = round_ % len(layouts)
        for layout in layouts[shift:] + layouts[:shift]:
            r = measure(engines[layout.name], recorders[layout.name], layout, model, dtype_bytes, workload,
                        decode_prompt, args.decode_tokens)
            rounds[layout.name].append(r)
            flag = "  ! others busy" if (r["others_busy_cores"] or 0) > BUSY_LIMIT else ""
            print(f"{round_:>5} {layout.name:>9} {r['tok_s']:>9.1f} {r['decode_ms_per_token']:>15.2f}{flag}",
                  flush=True)
    base_outputs = rounds[layouts[0].name][0]["outputs"]
    # Greedy tokens of random weights sit on near-ties: a different summation order (the all-reduce) may flip
    # some. Reported, not required; the step counts do not depend on them (ignore_eos).
    same = {name: sum(a == b for r in rs for a, b in zip(r["outputs"], base_outputs)) / sum(len(r["outputs"])
                                                                                          for r in rs)
            for name, rs in rounds.items()}
    summary = summarize(layouts, rounds)
    print_table(summary)
    for rs in rounds.values():
        for r in rs:
            del r["outputs"]
    result = {"machine": machine, "model": model_info, "args": {k: str(v) for k, v in vars(args).items()},
              "threads_per_rank": {layout.name: threads_per_rank(layout) for layout in layouts},
              "startup_s": startup,  # spawning the workers, loading the shards, sizing the KV cache
              "comm_bytes": "payload handed to torch.distributed per step, all ranks together, from the model's "
                            "shape (paged_runtime/utils/comm_volume.py, checked by tests/unit/test_comm_volume.py)",
              "pipe_bytes": "measured: pickled execute call x ranks + the driver's pickled answer",
              "summary": summary, "requests_identical_to_first_layout": same, "rounds": rounds}
    title = f"tensor / pipeline parallel, {machine['cpu_model']}, {machine['cpu_count']} cores ({args.dtype})"
    busy = max(s["others_busy_cores"] for s in summary.values())
    if busy > BUSY_LIMIT:  # a picture travels without its JSON
        title += f": measured while other work kept up to {busy:.1f} cores busy (not comparable)"
    print(write_results(out, result, draw, summary, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
