"""The default model's activations and KV cache dtype: bfloat16 / bfloat16, float32 / float32, float32 / bfloat16.

What it measures
    The embedded SmolLM2-135M-Instruct served as its GGUF's Q4_1 / Q8_0 blocks through the compiled CPU kernels,
    in three engines in one process: ``--dtype bfloat16`` (bfloat16 activations and cache), ``--dtype float32``
    (the default for a GGUF on the CPU: float32 activations, the cache in float32) and ``--dtype float32
    --kv-cache-dtype bfloat16``. Interleaved for ``--rounds`` rounds, each engine keeping its best figure:
    ms per decode step at batch 1 and 16 over 300-token contexts and at batch 1 over 1,500 tokens
    (``cpu_decode.decode_ms``), tokens / s on 64 mixed ShareGPT-like requests (``throughput.run_runtime``,
    every round but the last), and, once, perplexity over the first 1,536 tokens of
    ``tests/data/lighthouse_keepers.txt`` in windows of 512. The float32 / float32 engine is the baseline.

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/kv_cache_dtype.py      # ~5 minutes on 2 idle cores

Writes benchmarks/results/kv_cache_dtype-<device>.json and a PNG if matplotlib is installed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import machine_info, make_workload, others_busy_cores, result_path, write_results  # noqa: E402
from benchmarks.cpu_decode import decode_ms  # noqa: E402
from benchmarks.throughput import run_runtime, warm_up_runtime  # noqa: E402

VOCAB = 49152
CONFIGS = {"bfloat16, bfloat16": {"dtype": "bfloat16"},
           "float32, float32 (default)": {"dtype": "float32"},
           "float32, bfloat16 cache": {"dtype": "float32", "kv_cache_dtype": "bfloat16"}}
DECODES = ((1, 300), (16, 300), (1, 1500))  # (batch, context)
TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "lighthouse_keepers.txt"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per figure")
    args = p.parse_args()
    from paged_runtime import LLM
    from paged_runtime.utils.perplexity import perplexity
    engines = {name: LLM(max_model_len=2048, kv_cache_memory=2**30, max_num_seqs=256, max_num_batched_tokens=2048,
                         **kwargs) for name, kwargs in CONFIGS.items()}
    for llm in engines.values():
        assert llm.engine.core.ops.name == "cpu-kernels", "the compiled CPU kernels are not in use"
        warm_up_runtime(llm, VOCAB)
    work = make_workload(0, 64, 160, 64, 0.8, 2048, VOCAB)
    best: dict[str, dict[str, float]] = {name: {} for name in engines}
    busy = [others_busy_cores()]
    for r in range(args.rounds):
        for name, llm in engines.items():
            for batch, context in DECODES:
                key = f"batch {batch} @ {context}, ms"
                best[name][key] = min(best[name].get(key, float("inf")), decode_ms(llm, batch, context, args.steps, r))
            if r < max(1, args.rounds - 1):
                tok_s = run_runtime(llm, work)[0].tok_s
                best[name]["64 mixed, tok/s"] = max(best[name].get("64 mixed, tok/s", 0.0), tok_s)
        busy.append(others_busy_cores())
    ids = next(iter(engines.values())).get_tokenizer().encode(TEXT.read_text())[:1536]
    for name, llm in engines.items():
        best[name]["perplexity"] = perplexity(llm, ids, 512)
    keys = list(best[next(iter(best))])
    print(f"{'activations, KV cache':<28}" + "".join(f"{k:>22}" for k in keys))
    for name, row in best.items():
        print(f"{name:<28}" + "".join(f"{row[k]:>22.2f}" for k in keys))
    data = {"machine": machine_info(), "args": vars(args), "others_busy_cores": busy, "configs": CONFIGS,
            "model": "SmolLM2-135M-Instruct GGUF (Q4_1 / Q8_0 blocks), compiled CPU kernels", "best": best}
    print(write_results(result_path("kv_cache_dtype"), data, draw, best))
    return 0


def draw(plt, best):
    keys = [k for k in best[next(iter(best))] if k.endswith("ms")]
    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.8 / len(best)
    for i, (name, row) in enumerate(best.items()):
        ax.bar([j + i * width for j in range(len(keys))], [row[k] for k in keys], width, label=name)
    ax.set_xticks([j + width for j in range(len(keys))], keys)
    ax.set_ylabel("ms per decode step (best)")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    sys.exit(main())
