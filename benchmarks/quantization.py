"""Quantized weights against bfloat16, and the GGUF served as its blocks against llama.cpp, in one run.

What it measures
    Engines of the embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF with a Q8_0 embedding) in one
    process, identical but for ``quantization``: none = bfloat16 weights (the file dequantized), int8 = W8A16
    per output channel and int4 = W4A16 in groups of 128 (both quantized at load from those weights), gguf =
    the file's own Q4_1 / Q8_0 blocks (the default for a .gguf). And the peer, llama.cpp
    (``llama-cpp-python``, the ``bench-peers`` extra) on the same GGUF file with the same threads, where it
    installs. For each:

    * resident weight bytes: the model's parameters and buffers (whole model, and its decoder layers);
    * perplexity of tests/data/lighthouse_keepers.txt (~2,000 tokens, windows of ``--window``) from the
      engine's prompt logprobs;
    * per round (the engines in turn, the order alternating): batch 1, one request decoding
      ``--decode-tokens`` tokens (ms per output token, its 32-token prefill included), and the mixed
      workload (``benchmarks/common.py``, ``--num-requests`` at once, greedy, ``ignore_eos``: output tokens
      per second; llama.cpp, which has no continuous batching, serves them one after another).
      Each engine keeps its best round; ratios are against bfloat16 (and llama.cpp) from the same run.

    On the CPU int8 / int4 run through torch's weight-only kernels for bfloat16 activations; gguf through
    the compiled kernels (``kernels/cpu_ops.c``). Note: this model's weights come from a Q4_1 GGUF (4-bit
    grids of 32 columns), which int4's groups of 128 cannot follow: its perplexity cost is far larger than
    on a model trained in 16 bits.

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quantization.py --threads 2
    .venv/bin/python benchmarks/quantization.py --threads 2 --dtype auto  # as served: the GGUF in float32
    .venv/bin/python benchmarks/quantization.py --rounds 1 --decode-tokens 8 --num-requests 2 --ppl-tokens 256  # smoke

Writes benchmarks/results/quantization-<device>.json (and a PNG if matplotlib is installed).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (BUSY_LIMIT, ROOT, add_round_args, machine_info, others_busy_cores,  # noqa: E402
                               result_path, round_workload, timed_generate, write_results)

TEXT = ROOT / "tests" / "data" / "lighthouse_keepers.txt"
MODES = ("none", "int8", "int4", "gguf")
PEER = "llama.cpp"


class LlamaCppPeer:
    """llama.cpp on the same GGUF, greedy, one request after another (it has no continuous batching)."""

    def __init__(self, path: Path, threads: int, max_len: int) -> None:
        from llama_cpp import Llama
        self.path = path
        self.llm = Llama(model_path=str(path), n_ctx=max_len, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        start, outs = time.perf_counter(), []
        for prompt, n in zip(prompts, max_tokens):
            tokens = []
            for token in self.llm.generate(prompt, temp=0.0, reset=True):  # never stops by itself: ignore_eos
                tokens.append(token)
                if len(tokens) == n:
                    break
            outs.append(tokens)
        return time.perf_counter() - start, outs


def load_peer(threads: int, max_len: int) -> LlamaCppPeer | None:
    from paged_runtime.models.default_model import find_default_gguf
    try:
        return LlamaCppPeer(find_default_gguf(), threads, max_len)
    except ImportError:
        print("llama-cpp-python is not installed (pip install '.[bench-peers]'): no llama.cpp figures", flush=True)
        return None


def plain_checkpoint(folder: Path, into: Path) -> Path:
    """The converted GGUF's dequantized weights as a plain checkpoint (its files, without the blocks), the
    input int8 / int4 quantize at load (a GGUF itself refuses another --quantization)."""
    into.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and not (into / f.name).exists():
            (into / f.name).symlink_to(f)
    return into


def measure(llm, workload, decode_prompt: list[int], decode_tokens: int) -> dict:
    busy = others_busy_cores()
    run = llm.generate if isinstance(llm, LlamaCppPeer) else lambda *a: timed_generate(llm, *a)
    decode_s, _ = run([decode_prompt], [decode_tokens])
    seconds, tokens = run([r.prompt for r in workload], [r.output_len for r in workload])
    return {"decode_ms_per_token": decode_s * 1e3 / decode_tokens, "tok_s": sum(map(len, tokens)) / seconds,
            "others_busy_cores": busy}


def draw(plt, summary: dict, title: str):
    panels = (("weight_mib", "resident weights, MiB"), ("decode_ms_per_token", "batch 1, ms per token"),
              ("tok_s", "mixed workload, output tokens / s"), ("perplexity", "perplexity (lower is better)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.4))
    colors = {"none": "#888", "int8": "#36c", "int4": "#c63", "gguf": "#393", PEER: "#a3a"}
    for ax, (key, label) in zip(axes, panels):
        names = [n for n in summary if key in summary[n]]
        ax.bar(names, [summary[n][key] for n in names], color=[colors[n] for n in names])
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=9)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_round_args(p, num_requests=32, output_mean=32.0, prompt_mean=64.0, decode_tokens=32, rounds=2)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--ppl-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "auto"),
                   help="every engine's activations; auto: each one's own (the GGUF blocks float32, as the default "
                        "model is served; the dequantized checkpoint its bfloat16)")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp even where it is installed")
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. who else shared the machine)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from paged_runtime import LLM
    from paged_runtime.layers.quantization import resident_bytes
    from paged_runtime.utils.perplexity import perplexity
    out = args.out or result_path("quantization", None if args.dtype == "bfloat16" else args.dtype)
    from paged_runtime.models.default_model import default_model_path
    plain = plain_checkpoint(default_model_path(), Path(tempfile.mkdtemp(prefix="smollm2-plain-")))
    engines = {mode: LLM(model=None if mode == "gguf" else str(plain), dtype=args.dtype, quantization=mode,
                         max_model_len=args.max_model_len, seed=0, max_num_seqs=max(args.num_requests, 1),
                         kv_cache_memory=256 << 20, enable_prefix_caching=False) for mode in MODES}
    vocab = engines["none"].engine.vocab_size
    workload, decode_prompt = round_workload(args, vocab)
    machine = machine_info() | {"dtype": args.dtype, "ops": engines["none"].engine.core.ops.name, "note": args.note}
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, torch {machine['torch']} "
          f"({machine['torch_threads']} threads), {args.dtype}, ops {machine['ops']}", flush=True)
    summary = {}
    ids = engines["none"].get_tokenizer().encode(TEXT.read_text())[:args.ppl_tokens]
    for mode, llm in engines.items():
        model = llm.engine.core.executor.worker.model
        start = time.perf_counter()
        ppl = perplexity(llm, ids, args.window)
        summary[mode] = {"weight_bytes": resident_bytes(model), "decoder_layer_bytes": resident_bytes(model.layers),
                         "perplexity": ppl, "perplexity_seconds": time.perf_counter() - start}
        summary[mode]["weight_mib"] = summary[mode]["weight_bytes"] / 2**20
        print(f"{mode:>9}: {summary[mode]['weight_mib']:.1f} MiB of weights, perplexity {ppl:.3f} "
              f"over {len(ids)} tokens", flush=True)
        timed_generate(llm, [decode_prompt] * 2, [4, 4])  # warm-up
    peer = load_peer(torch.get_num_threads(), args.max_model_len) if not args.no_peer else None
    if peer is not None:
        engines[PEER] = peer
        summary[PEER] = {"weight_bytes": peer.path.stat().st_size, "weight_mib": peer.path.stat().st_size / 2**20}
        peer.generate([decode_prompt], [4])  # warm-up
    names = list(engines)
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    print(f"{'round':>5} {'engine':>9} {'ms/token (b=1)':>15} {'tok/s (mixed)':>14}")
    for round_ in range(args.rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            r = measure(engines[name], workload, decode_prompt, args.decode_tokens)
            rounds[name].append(r)
            flag = "  ! others busy" if (r["others_busy_cores"] or 0) > BUSY_LIMIT else ""
            print(f"{round_:>5} {name:>9} {r['decode_ms_per_token']:>15.2f} {r['tok_s']:>14.1f}{flag}", flush=True)
    for name in names:
        s = summary[name]
        s["decode_ms_per_token"] = min(r["decode_ms_per_token"] for r in rounds[name])
        s["tok_s"] = max(r["tok_s"] for r in rounds[name])
    base = summary["none"]
    for mode in MODES:
        s = summary[mode]
        s["ratios_vs_bf16"] = {"weight_bytes": s["weight_bytes"] / base["weight_bytes"],
                               "decoder_layer_bytes": s["decoder_layer_bytes"] / base["decoder_layer_bytes"],
                               "perplexity": s["perplexity"] / base["perplexity"],
                               "decode_speedup": base["decode_ms_per_token"] / s["decode_ms_per_token"],
                               "throughput": s["tok_s"] / base["tok_s"]}
        if peer is not None:
            s["vs_llama_cpp"] = {"decode_speedup": summary[PEER]["decode_ms_per_token"] / s["decode_ms_per_token"],
                                 "throughput": s["tok_s"] / summary[PEER]["tok_s"]}
    print(f"\n{'engine':>9} {'weights MiB':>12} {'x bf16':>7} {'layers x':>9} {'ms/tok b=1':>11} {'speedup':>8} "
          f"{'tok/s':>8} {'x bf16':>7} {'ppl':>8} {'x bf16':>7} {'b=1 x llama.cpp':>16} {'tok/s x llama.cpp':>18}")
    for name in names:
        s, r, v = summary[name], summary[name].get("ratios_vs_bf16", {}), summary[name].get("vs_llama_cpp", {})
        cell = lambda d, k, fmt: format(d[k], fmt) if k in d else "-"  # noqa: E731
        print(f"{name:>9} {s['weight_mib']:>12.1f} {cell(r, 'weight_bytes', '>7.3f'):>7} "
              f"{cell(r, 'decoder_layer_bytes', '>9.3f'):>9} {s['decode_ms_per_token']:>11.1f} "
              f"{cell(r, 'decode_speedup', '>8.2f'):>8} {s['tok_s']:>8.1f} {cell(r, 'throughput', '>7.2f'):>7} "
              f"{cell(s, 'perplexity', '>8.3f'):>8} {cell(r, 'perplexity', '>7.3f'):>7} "
              f"{cell(v, 'decode_speedup', '>16.2f'):>16} {cell(v, 'throughput', '>18.2f'):>18}")
    result = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
              "rounds": rounds}
    title = f"quantized weights and llama.cpp, SmolLM2-135M, {machine['cpu_model']} ({args.dtype} activations)"
    print(write_results(out, result, draw, summary, title))
    for name in MODES:
        engines[name].engine.core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
