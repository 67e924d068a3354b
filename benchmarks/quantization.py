"""Weight-only quantization (``--quantization int8 | int4``) against bfloat16 weights, measured in one run.

What it measures
    Three engines of the embedded default model (SmolLM2-135M-Instruct) in one process, identical but for
    ``quantization`` (none = bfloat16 weights, int8 = W8A16 per output channel, int4 = W4A16 in groups of
    128, asymmetric). For each:

    * resident weight bytes: the model's parameters and buffers (whole model, and its decoder layers: the
      embedding / tied LM head stay bfloat16);
    * perplexity of tests/data/lighthouse_keepers.txt (~2,000 tokens, windows of ``--window``) from the
      engine's prompt logprobs;
    * per round (the engines in turn, the order alternating): batch 1, one request decoding
      ``--decode-tokens`` tokens (ms per output token), and a small mixed workload
      (``benchmarks/workload.py``, all requests at once, greedy, ``ignore_eos``: output tokens per second).
      Each engine keeps its best round; ratios are against bfloat16 from the same run.

    On the CPU the products run through torch's weight-only kernels (``_weight_int8pack_mm``,
    ``_weight_int4pack_mm_for_cpu``) for bfloat16 activations. Note: this model's weights come from a Q4_1
    GGUF (4-bit grids of 32 columns), which int4's groups of 128 cannot follow: its perplexity cost is far
    larger than on a model trained in 16 bits.

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/quantization.py
    .venv/bin/python benchmarks/quantization.py --rounds 1 --decode-tokens 8 --num-requests 2 --ppl-tokens 256  # smoke

Writes benchmarks/results/quantization-<device>.json (and a PNG if matplotlib is installed).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import BUSY_LIMIT, machine_info, others_busy_cores  # noqa: E402
from workload import make_workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TEXT = ROOT / "tests" / "data" / "lighthouse_keepers.txt"
MODES = ("none", "int8", "int4")


def timed_generate(llm, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    from paged_runtime import SamplingParams
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def measure(llm, workload, decode_prompt: list[int], decode_tokens: int) -> dict:
    busy = others_busy_cores()
    decode_s, _ = timed_generate(llm, [decode_prompt], [decode_tokens])
    seconds, tokens = timed_generate(llm, [r.prompt for r in workload], [r.output_len for r in workload])
    return {"decode_ms_per_token": decode_s * 1e3 / decode_tokens, "tok_s": sum(map(len, tokens)) / seconds,
            "others_busy_cores": busy}


def plot(summary: dict, path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = (("weight_mib", "resident weights, MiB"), ("decode_ms_per_token", "batch 1, ms per token"),
              ("tok_s", "mixed workload, output tokens / s"), ("perplexity", "perplexity (lower is better)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.2))
    for ax, (key, label) in zip(axes, panels):
        ax.bar(list(MODES), [summary[m][key] for m in MODES], color=["#888", "#36c", "#c63"])
        ax.set_title(label, fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--output-mean", type=float, default=32.0)
    p.add_argument("--prompt-mean", type=float, default=64.0)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--ppl-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. who else shared the machine)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from paged_runtime import LLM
    from paged_runtime.layers.quantization import resident_bytes
    from paged_runtime.utils.perplexity import perplexity
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or RESULTS / f"quantization-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    engines = {mode: LLM(model=None, dtype="bfloat16", quantization=mode, max_model_len=args.max_model_len, seed=0,
                         max_num_seqs=max(args.num_requests, 1), kv_cache_memory=256 << 20,
                         enable_prefix_caching=False) for mode in MODES}
    vocab = engines["none"].engine.vocab_size
    workload = make_workload(0, args.num_requests, args.prompt_mean, args.output_mean, args.sigma,
                             args.max_model_len, vocab)
    decode_prompt = make_workload(1, 1, 32, 1, 0.1, args.max_model_len, vocab)[0].prompt
    machine = machine_info() | {"dtype": "bfloat16", "ops": engines["none"].engine.core.ops.name, "note": args.note}
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, torch {machine['torch']} "
          f"({machine['torch_threads']} threads), bfloat16, ops {machine['ops']}", flush=True)
    summary = {}
    ids = engines["none"].get_tokenizer().encode(TEXT.read_text())[:args.ppl_tokens]
    for mode, llm in engines.items():
        model = llm.engine.core.executor.worker.model
        start = time.perf_counter()
        ppl = perplexity(llm, ids, args.window)
        summary[mode] = {"weight_bytes": resident_bytes(model), "decoder_layer_bytes": resident_bytes(model.layers),
                         "perplexity": ppl, "perplexity_seconds": time.perf_counter() - start}
        summary[mode]["weight_mib"] = summary[mode]["weight_bytes"] / 2**20
        print(f"{mode:>5}: {summary[mode]['weight_mib']:.1f} MiB of weights, perplexity {ppl:.3f} "
              f"over {len(ids)} tokens", flush=True)
        timed_generate(llm, [decode_prompt] * 2, [4, 4])  # warm-up
    rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
    print(f"{'round':>5} {'mode':>5} {'ms/token (b=1)':>15} {'tok/s (mixed)':>14}")
    for round_ in range(args.rounds):
        for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
            r = measure(engines[mode], workload, decode_prompt, args.decode_tokens)
            rounds[mode].append(r)
            flag = "  ! others busy" if (r["others_busy_cores"] or 0) > BUSY_LIMIT else ""
            print(f"{round_:>5} {mode:>5} {r['decode_ms_per_token']:>15.2f} {r['tok_s']:>14.1f}{flag}", flush=True)
    base = summary["none"]
    for mode in MODES:
        s = summary[mode]
        s["decode_ms_per_token"] = min(r["decode_ms_per_token"] for r in rounds[mode])
        s["tok_s"] = max(r["tok_s"] for r in rounds[mode])
    for mode in MODES:
        s = summary[mode]
        s["ratios_vs_bf16"] = {"weight_bytes": s["weight_bytes"] / base["weight_bytes"],
                               "decoder_layer_bytes": s["decoder_layer_bytes"] / base["decoder_layer_bytes"],
                               "perplexity": s["perplexity"] / base["perplexity"],
                               "decode_speedup": base["decode_ms_per_token"] / s["decode_ms_per_token"],
                               "throughput": s["tok_s"] / base["tok_s"]}
    print(f"\n{'mode':>5} {'weights MiB':>12} {'x bf16':>7} {'layers x':>9} {'ms/tok b=1':>11} {'speedup':>8} "
          f"{'tok/s':>8} {'x bf16':>7} {'ppl':>8} {'x bf16':>7}")
    for mode in MODES:
        s, r = summary[mode], summary[mode]["ratios_vs_bf16"]
        print(f"{mode:>5} {s['weight_mib']:>12.1f} {r['weight_bytes']:>7.3f} {r['decoder_layer_bytes']:>9.3f} "
              f"{s['decode_ms_per_token']:>11.1f} {r['decode_speedup']:>8.2f} {s['tok_s']:>8.1f} "
              f"{r['throughput']:>7.2f} {s['perplexity']:>8.3f} {r['perplexity']:>7.3f}")
    result = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
              "rounds": rounds}
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    if plot(summary, png, f"weight-only quantization, SmolLM2-135M, {machine['cpu_model']} (bfloat16 activations)"):
        print(f"wrote {out} and {png}")
    else:
        print(f"wrote {out}")
    for llm in engines.values():
        llm.engine.core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
