"""Decode step time per model family: paged-runtime against transformers on the same random weights.

What it measures
    For each family, a random model of a published small model's shape (random
    weights, nothing downloaded), saved as a real safetensors folder with SmolLM2's
    tokenizer (ids the tokenizer lacks decode to nothing). Both sides run the same
    weights in ``--dtype`` on this machine's CPU:

    - paged-runtime: ``LLM(model=folder)`` with its defaults for the device; ``batch``
      requests of ``--context`` random tokens are prefilled, then ``--steps`` decode
      steps are timed (``engine.step()``, one new token per request);
    - transformers: the same prompts prefilled in one forward, then ``--steps`` decode
      forwards with its KV cache (``cache``), greedy.

    Each side keeps its fastest of ``--rounds`` interleaved rounds. The ratio
    (transformers ms / ours) is the figure to read; absolute times on a shared
    2-core machine are noise. Where a shape is too large for this machine's memory
    twice over (ours and transformers' copy), fewer layers are built than the
    published model has: the table says how many.

Writes results/models-<device>.json and, with matplotlib (the ``bench`` extra), models-<device>.png.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/models.py
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/models.py --families qwen3 gemma3 --batch 1 --steps 5
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (copy_tokenizer, machine_info, others_busy_cores, result_path,  # noqa: E402
                               write_json, write_png)
from benchmarks.cpu_decode import decode_ms  # noqa: E402

# family -> (transformers config class, the published model it takes its shape from, config kwargs).
# "num_hidden_layers" is the published count; --max-layers may build fewer.
FAMILIES = {
    "llama": ("LlamaConfig", "Llama-3.2-1B", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3-0.6B", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma-3-1B", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, rope_theta=1000000.0,
        rope_local_base_freq=10000.0)),
    "phi3": ("Phi3Config", "Phi-4-mini", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, partial_rotary_factor=0.75, tie_word_embeddings=True, pad_token_id=0)),
    "olmoe": ("OlmoeConfig", "OLMoE-1B-7B", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, pad_token_id=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3-30B-A3B", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", "Mixtral-8x7B", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0)),
}
# Layers built by default where the published count would not fit twice in 24 GiB in bfloat16.
DEFAULT_MAX_LAYERS = {"phi3": 8, "olmoe": 4, "qwen3_moe": 2, "mixtral": 1}


def build_folder(family: str, layers: int | None, dtype: torch.dtype, root: Path):
    """A random model of the family's shape saved in ``root``; returns (folder, transformers model, layers)."""
    import transformers
    class_name, _, kwargs = FAMILIES[family]
    kwargs = dict(kwargs, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    kwargs["num_hidden_layers"] = min(kwargs["num_hidden_layers"], layers or kwargs["num_hidden_layers"])
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    folder = root / family
    model.save_pretrained(folder, safe_serialization=True)
    if torch.cuda.is_available():
        model.to("cuda")
    copy_tokenizer(folder)
    return folder, model, kwargs["num_hidden_layers"]


def hf_decode_ms(model, batch: int, context: int, steps: int, seed: int, max_token_id: int) -> float:
    """transformers: milliseconds per greedy decode forward of ``batch`` rows at ``context`` tokens."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    prompts = torch.tensor([[rng.randrange(3, max_token_id) for _ in range(context)] for _ in range(batch)],
                           device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        out = model(prompts, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)  # transformers >= 5.24 spells it `cache`
        for _ in range(2):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        sync()
        return (time.perf_counter() - start) / steps * 1000


def measure_family(family: str, args, root: Path) -> dict:
    from paged_runtime import LLM
    from paged_runtime.models.registry import architectures
    dtype = getattr(torch, args.dtype)
    folder, hf_model, layers = build_folder(family, args.max_layers or DEFAULT_MAX_LAYERS.get(family), dtype, root)
    architecture = hf_model.config.architectures[0]
    row = {"family": family, "shape_of": FAMILIES[family][1], "architecture": architecture, "layers": layers,
           "published_layers": FAMILIES[family][2]["num_hidden_layers"],
           "parameters": sum(p.numel() for p in hf_model.parameters())}
    if architecture not in architectures():
        row["skipped"] = f"{architecture} is not supported here"
        return row
    llm = LLM(model=str(folder), dtype=args.dtype, max_model_len=args.context + args.steps + 32,
              max_num_seqs=max(args.batch), max_num_batched_tokens=max(4096, args.context),
              kv_cache_memory=args.kv_cache_gib * 2**30)
    max_token_id = min(49000, hf_model.config.vocab_size)  # prompts the model and the tokenizer both know
    ours: dict[int, float] = {}
    theirs: dict[int, float] = {}
    for round_ in range(args.rounds):
        for batch in args.batch:
            ms = decode_ms(llm, batch, args.context, args.steps, seed=round_, max_token_id=max_token_id)
            ours[batch] = min(ours.get(batch, ms), ms)
            ms = hf_decode_ms(hf_model, batch, args.context, args.steps, seed=round_, max_token_id=max_token_id)
            theirs[batch] = min(theirs.get(batch, ms), ms)
    row["ops"] = llm.engine.core.ops.name
    row["batches"] = [{"batch": b, "ours_ms": ours[b], "transformers_ms": theirs[b], "speedup": theirs[b] / ours[b]}
                      for b in args.batch]
    del llm, hf_model
    gc.collect()
    shutil.rmtree(folder)
    return row


def print_table(rows: list[dict], args) -> None:
    print(f"decode step, {args.dtype}, context {args.context}, {args.steps} steps, best of {args.rounds} rounds")
    print(f"{'family':10s} {'shape of':15s} {'layers':>7s} {'params':>7s} {'batch':>5s} {'ours ms':>8s} "
          f"{'HF ms':>8s} {'speedup':>8s}")
    for row in rows:
        layers = f"{row['layers']}/{row['published_layers']}"
        head = f"{row['family']:10s} {row['shape_of']:15s} {layers:>7s} {row['parameters'] / 1e9:6.2f}B"
        if "skipped" in row:
            print(f"{head}  {row['skipped']}")
        for b in row.get("batches", []):
            print(f"{head} {b['batch']:5d} {b['ours_ms']:8.1f} {b['transformers_ms']:8.1f} {b['speedup']:7.2f}x")


def draw(plt, rows: list[dict]):
    measured = [r for r in rows if "batches" in r]
    batches = sorted({b["batch"] for r in measured for b in r["batches"]})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(batches))
    for i, batch in enumerate(batches):
        speedups = [next((b["speedup"] for b in r["batches"] if b["batch"] == batch), 0) for r in measured]
        ax.bar([x + i * width for x in range(len(measured))], speedups, width, label=f"batch {batch}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(batches) - 1) / 2 for x in range(len(measured))],
                  [f"{r['family']}\n({r['shape_of']})" for r in measured], fontsize=8)
    ax.set_ylabel("decode step speedup over transformers")
    ax.legend()
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-layers", type=int, default=None, help="build at most this many layers of every family")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = p.parse_args(argv)
    busy = others_busy_cores()
    out = result_path("models")
    # Families not measured in this run keep their rows from the last one (each row is one run's ratio).
    kept = json.loads(out.read_text())["rows"] if out.exists() else []
    rows = []
    with tempfile.TemporaryDirectory(prefix="models-bench-") as root:
        for family in args.families:  # each family's row is printed and saved as soon as it is measured
            rows.append(measure_family(family, args, Path(root)))
            print_table(rows[-1:], args)
            measured = {r["family"] for r in rows}
            every = [r for r in kept if r["family"] not in measured] + rows
            every.sort(key=lambda r: list(FAMILIES).index(r["family"]))
            write_json(out, {"parameters": vars(args), "machine": machine_info(), "others_busy_cores": busy,
                             "rows": every})
    every = json.loads(out.read_text())["rows"]
    print_table(every, args)
    print(f"wrote {out}")
    png = write_png(out.with_suffix(".png"), draw, every)
    print(f"wrote {png}" if png else "no PNG: matplotlib not installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
