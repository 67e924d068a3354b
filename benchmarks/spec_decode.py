"""Speculative decoding: greedy tokens/s with and without it, at batch 1 and batch 16.

What it measures
    The embedded SmolLM2-135M-Instruct (bf16 unless --dtype) answers chat
    prompts greedily (outputs are identical with and without speculation, which
    the script checks). Two workloads:

    1. "repetitive": rewrite/copy tasks over given text and code with repeated
       identifiers, where prompt lookup (n-gram) drafts are often right;
    2. the same prompts with a draft model built from the target's first
       ``--draft-layers`` layers (no smaller sibling can be downloaded here).

    Batch 1 runs the prompts one after another; batch 16 submits them together.
    The systems run interleaved, ``--repeats`` times, and each keeps its fastest run.
    tokens/s = output tokens / wall seconds. Mean accepted length = tokens
    emitted per verification = 1 + accepted drafts / verifications. Every
    speculative run is compared with the plain run of the same batch size in
    the same process (ratios; absolute times on a shared 2-core machine are noise).

Writes results/spec_decode-<device>.json (spec_decode-float32-<device>.json with ``--dtype float32``; and a PNG
when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import machine_info, others_busy_cores, result_path, write_results  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps while the quick brown fox runs.",
    "def total_price(items):\n    total_price = 0\n    for item in items:\n        total_price += item.price "
    "* item.quantity\n    return total_price\n",
    "Our meeting is moved from Monday to Tuesday. On Tuesday the meeting starts at ten, and the meeting room is B2.",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n        "
    "self.count += 1\n        return self.count\n",
]
TASKS = ["Repeat the following text exactly, word for word:\n\n{}",
         "Fix any typos in the following text and return the full corrected text:\n\n{}",
         "Copy this code exactly, then stop:\n\n{}",
         "Rewrite the following, keeping every word the same:\n\n{}"]


def prompts(tokenizer, count: int) -> list[str]:
    out = []
    for i in range(count):
        text = TASKS[i % len(TASKS)].format(TEXTS[(i // len(TASKS) + i) % len(TEXTS)])
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True))
    return out


def run(llm, texts: list[str], batch: int, max_tokens: int) -> dict:
    from paged_runtime import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    spec = llm.engine.core.spec_stats
    before = (spec.num_drafts, spec.num_accepted_tokens)
    busy_before = others_busy_cores()
    start = time.perf_counter()
    outputs = []
    for first in range(0, len(texts), batch):
        outputs += llm.generate(texts[first:first + batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    drafts, accepted = spec.num_drafts - before[0], spec.num_accepted_tokens - before[1]
    return {"batch": batch, "output_tokens": sum(map(len, tokens)), "seconds": round(seconds, 3),
            "tok_s": round(sum(map(len, tokens)) / seconds, 2),
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "others_busy_cores": (busy_before, others_busy_cores()), "tokens": tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--batch-1-prompts", type=int, default=4, help="prompts run one at a time for batch 1")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the fastest is kept")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from paged_runtime import LLM
    from paged_runtime.models.default_model import default_model_path
    from paged_runtime.spec_decode.truncated_draft import write_truncated_draft
    target = default_model_path()
    draft = write_truncated_draft(target, Path(tempfile.mkdtemp()) / "draft", args.draft_layers)
    configs = {"plain": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4},
               f"draft ({args.draft_layers} layers)": {"method": "draft_model", "model": str(draft),
                                                        "num_speculative_tokens": args.k}}
    engines = {}
    for name, spec in configs.items():
        llm = LLM(dtype=args.dtype, max_model_len=1024, kv_cache_memory=512 * 2**20, speculative_config=spec)
        texts = prompts(llm.get_tokenizer(), args.num_prompts)
        llm.generate(texts[:1], use_tqdm=False)  # warm-up
        engines[name] = llm
    # Interleaved repeats (plain, ngram, draft, plain, ...): the fastest of each row is reported, so
    # a burst of load from elsewhere on a shared machine hits every system alike rather than one.
    best: dict[tuple[str, int], dict] = {}
    for _ in range(args.repeats):
        for batch, subset in ((1, texts[:args.batch_1_prompts]), (16, texts)):
            for name, llm in engines.items():
                row = {"system": name, **run(llm, subset, batch, args.max_tokens)}
                key = (name, batch)
                if key not in best or row["seconds"] < best[key]["seconds"]:
                    best[key] = row
    rows = sorted(best.values(), key=lambda r: (list(configs).index(r["system"]), r["batch"]))
    plain = {r["batch"]: r for r in rows if r["system"] == "plain"}
    print(f"{'system':<22}{'batch':>6}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'accepted len':>14}{'vs plain':>10}")
    for r in rows:
        base = plain[r["batch"]]
        r["speedup"] = round(r["tok_s"] / base["tok_s"], 3)
        r["identical_to_plain"] = r["tokens"] == base["tokens"]
        accepted = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        print(f"{r['system']:<22}{r['batch']:>6}{r['output_tokens']:>8}{r['seconds']:>9.2f}{r['tok_s']:>8.1f}"
              f"{accepted:>14}{r['speedup']:>9.2f}x" + ("" if r["identical_to_plain"] else "  output differs"))
    if not all(r["identical_to_plain"] for r in rows):
        print("(outputs differ: in float32 they must not; in bfloat16 verification scores k + 1 rows per request,"
              " so a near-tie can round the other way, as with any change of batch shape)")
    ngram_b1 = next(r for r in rows if r["system"] == "ngram" and r["batch"] == 1)
    print(f"\nn-gram speed-up at batch 1: {ngram_b1['speedup']:.2f}x (target >= 1.5x: "
          f"{'met' if ngram_b1['speedup'] >= 1.5 else 'NOT met'})")
    out = args.out or result_path("spec_decode", None if args.dtype == "bfloat16" else args.dtype)
    for r in rows:
        r.pop("tokens")
    print(write_results(out, {"machine": machine_info(), "parameters": vars(args) | {"out": str(out)},
                              "results": rows}, draw, rows))
    return 0


def draw(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{r['system']} b{r['batch']}" for r in rows]
    ax.barh(labels[::-1], [r["speedup"] for r in rows][::-1])
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("tokens/s relative to plain decoding (same batch)")
    return fig


if __name__ == "__main__":
    sys.exit(main())
