"""GPU kernels and end-to-end throughput: Triton paged attention against the memory floor,
the runtime against transformers. CUDA only.

What it measures (one CUDA device, named in every figure)
    (a) Copy bandwidth: device-to-device copy of a 1 GiB buffer; bytes read + written
        per second (median of triton.testing.do_bench, which flushes L2 between runs).
        This is the floor every memory-bound figure is compared with.
    (b) Decode attention: one query token per sequence, Llama-3-8B attention shape
        (32 query heads, 8 KV heads, head dim 128, bfloat16, blocks of 16 tokens, block
        tables scattered at random over the cache), contexts 512 .. 32k and batch 1 .. 256
        (pairs whose KV exceeds --kv-gib are skipped). The Triton kernel runs as the
        runtime runs it (split-KV by the same rule; each JSON row records the segment count,
        the SM count it came from and the tile shape: tile_n, num_warps, num_stages, the
        constants in paged_runtime/kernels/attention.py to tune); achieved bandwidth = KV bytes read
        (batch x context x KV heads x head dim x 2 x 2 bytes) / time, and its share of
        copy bandwidth. Next to it ``scaled_dot_product_attention`` on contiguous
        [batch, KV heads, context, head dim] K/V (``enable_gqa``): the peer without paging.
    (c) End to end, per model (random-weight Llama 3.2 1B and Llama 3.1 8B shapes, built
        once on the GPU and saved under --model-cache; no downloads), bfloat16:
        - batch-1 decode: ms per step after a 128-token prompt, against the floor
          weight bytes / copy bandwidth, with CUDA graphs (the default) and without
          (``enforce_eager``);
        - a mixed workload (benchmarks/common.py: ShareGPT-like lognormal prompt and
          output lengths, greedy, ignore_eos): the runtime with every request submitted
          at once, and transformers ``generate`` with static batches of
          --hf-batch-size on a prefix of the same requests; output tokens / s.
          Prompts use the SmolLM2 tokenizer's id range (the model folders carry that
          tokenizer; generated ids may lie beyond it, which only affects text).

Targets (H100, from issue 6): decode attention >= 70% of copy bandwidth at contexts
>= 4k; batch-1 decode step <= 1.3x weight bytes / copy bandwidth; runtime >= 10x
transformers on the mixed workload.

How to run (on a machine with a CUDA GPU)
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/kernels.py
    .venv/bin/python benchmarks/kernels.py --skip-e2e               # kernels only, about a minute
    .venv/bin/python benchmarks/kernels.py --models 1b --num-requests 64

Prints tables, writes benchmarks/results/kernels-<card>.json (card: h200, h100, ...).
"""
from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (FIRST_ORDINARY_ID, copy_tokenizer, machine_info, make_workload,  # noqa: E402
                               result_path, write_results)

TARGETS = {"decode_attention_copy_share": 0.70, "batch1_step_vs_floor": 1.3, "vs_transformers": 10.0}
LONG_CONTEXT = 4096  # contexts from here on are held to the bandwidth target
TOKENIZER_VOCAB = 49152  # SmolLM2's tokenizer, copied into the random model folders
ATTN_SHAPE = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)

LLAMA_CONFIGS = {  # Llama 3.2 1B and Llama 3.1 8B shapes
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--contexts", default="512,1024,2048,4096,8192,16384,32768")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--kv-gib", type=float, default=16.0, help="skip (batch, context) pairs whose KV exceeds this")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--models", default="1b,8b", help="comma-separated keys of LLAMA_CONFIGS")
    p.add_argument("--model-cache", type=Path, default=Path("/tmp/paged-runtime-random-llama"))
    p.add_argument("--num-requests", type=int, default=128, help="mixed workload size for the runtime")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--hf-batches", type=int, default=1, help="static batches transformers runs")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/kernels-<card>.json)")
    return p.parse_args(argv)


def bench_ms(fn) -> float:
    """Median ms of ``fn`` (CUDA events; L2 flushed before each run)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# ---- (a) copy bandwidth ---------------------------------------------------------------
def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (each byte is read once and written once)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * 2**30 / (ms / 1e3)


# ---- (b) decode attention -------------------------------------------------------------
def decode_attention(contexts: list[int], batches: list[int], kv_gib: float, copy_bw: float) -> list[dict]:
    from paged_runtime.kernels import attention

    s = ATTN_SHAPE
    bytes_per_token = s["num_kv_heads"] * s["head_dim"] * 2 * 2  # K and V, bf16
    max_tokens = int(kv_gib * 2**30 / bytes_per_token)
    num_blocks = max_tokens // s["block_size"]
    cache = torch.randn(num_blocks * s["block_size"], 2, s["num_kv_heads"], s["head_dim"],
                        dtype=torch.bfloat16, device="cuda")
    rows = []
    for context in contexts:
        for batch in batches:
            if batch * context > max_tokens or 2 * batch * context * bytes_per_token > torch.cuda.mem_get_info()[0]:
                print(f"  skip batch {batch} x context {context}: KV beyond --kv-gib or free memory", flush=True)
                continue
            rows.append(_decode_row(cache, batch, context, bytes_per_token, copy_bw, attention))
            r = rows[-1]
            print(f"  batch {batch:>4} context {context:>6}: triton {r['triton_us']:9.1f} us "
                  f"{r['triton_gb_s']:7.0f} GB/s ({r['triton_copy_share']:.0%} of copy, {r['splits']} splits)  "
                  f"sdpa {r['sdpa_us']:9.1f} us", flush=True)
    del cache
    torch.cuda.empty_cache()
    return rows


def _decode_row(cache, batch: int, context: int, bytes_per_token: int, copy_bw: float, attention) -> dict:
    s = ATTN_SHAPE
    blocks_per_seq = -(-context // s["block_size"])
    num_blocks = cache.shape[0] // s["block_size"]
    tables = torch.randperm(num_blocks, device="cuda")[:batch * blocks_per_seq].view(batch, blocks_per_seq)
    q = torch.randn(batch, s["num_heads"], s["head_dim"], dtype=torch.bfloat16, device="cuda")
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    tables = tables.to(torch.int32)
    scale = s["head_dim"] ** -0.5
    splits = attention.num_kv_splits(batch, s["num_kv_heads"], 1, context)
    out = torch.empty_like(q)
    triton_ms = bench_ms(lambda: attention.paged_attention(q, cache, query_start_loc, seq_lens, tables,
                                                           s["block_size"], 1, scale, splits, out=out))
    sdpa_ms = _sdpa_ms(q, batch, context, scale)
    kv_bytes = batch * context * bytes_per_token
    tile_n, num_warps, num_stages = attention.tile_shape(s["head_dim"], 1)
    return {"batch": batch, "context": context, "splits": splits, "kv_bytes": kv_bytes,
            "sm_count": attention.sm_count(), "tile_n": tile_n, "num_warps": num_warps, "num_stages": num_stages,
            "triton_us": triton_ms * 1e3, "triton_gb_s": kv_bytes / triton_ms / 1e6,
            "triton_copy_share": kv_bytes / (triton_ms / 1e3) / copy_bw,
            "sdpa_us": sdpa_ms * 1e3, "sdpa_gb_s": kv_bytes / sdpa_ms / 1e6,
            "sdpa_copy_share": kv_bytes / (sdpa_ms / 1e3) / copy_bw}


def _sdpa_ms(q: torch.Tensor, batch: int, context: int, scale: float) -> float:
    s = ATTN_SHAPE
    shape = (batch, s["num_kv_heads"], context, s["head_dim"])
    k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    q4 = q.unsqueeze(2)  # [batch, heads, 1, head dim]
    ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
    del k, v
    return ms


# ---- (c) end to end -------------------------------------------------------------------
def random_llama(key: str, cache_dir: Path) -> Path:
    """A Llama folder with random bf16 weights (built on the GPU, saved once) and SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = cache_dir / f"llama-{key}-random"
    if (folder / "config.json").exists():
        return folder
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **LLAMA_CONFIGS[key])
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    tmp = folder.with_suffix(".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    copy_tokenizer(tmp)
    tmp.rename(folder)
    del model
    _free_gpu()
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def batch1_step_ms(llm) -> float:
    """Median step time of one greedy request decoding 128 tokens after a 128-token prompt."""
    from paged_runtime import SamplingParams
    engine = llm.engine
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [FIRST_ORDINARY_ID] * 32}] * 4, greedy(8), use_tqdm=False)  # compile, warm
    engine.add_request("b1", {"prompt_token_ids": list(range(FIRST_ORDINARY_ID, FIRST_ORDINARY_ID + 128))},
                       greedy(129))
    engine.step()
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return 1e3 * float(np.median(steps))


def run_runtime(folder: Path, work, max_model_len: int) -> dict:
    from paged_runtime import LLM, SamplingParams

    common = dict(model=str(folder), dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=256, seed=0)
    eager = LLM(enforce_eager=True, **common)  # the same step without CUDA graphs
    eager_ms = batch1_step_ms(eager)
    del eager
    _free_gpu()
    llm = LLM(**common)
    engine = llm.engine
    batch1_ms = batch1_step_ms(llm)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, r in enumerate(work):
        engine.add_request(f"mixed-{i}", {"prompt_token_ids": r.prompt}, greedy(r.output_len))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - start
    backend = engine.core.runner.attention_backend
    del llm, engine
    _free_gpu()
    return {"attention_backend": backend, "batch1_step_ms": batch1_ms, "batch1_step_ms_eager": eager_ms,
            "requests": len(work), "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def run_transformers(folder: Path, work, batch_size: int, num_batches: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    _hf_generate(model, [[FIRST_ORDINARY_ID] * 32] * 2, 8)  # warm
    sample = work[:batch_size * num_batches]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(sample), batch_size):
        batch = sample[i:i + batch_size]
        _hf_generate(model, [r.prompt for r in batch], max(r.output_len for r in batch))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(r.output_len for r in sample)  # each request's own tokens; padding rows' extra steps are waste
    del model
    _free_gpu()
    return {"requests": len(sample), "batch_size": batch_size, "output_tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds}


@torch.inference_mode()
def _hf_generate(model, prompts: list[list[int]], new_tokens: int) -> None:
    """Greedy, exactly ``new_tokens`` per row, prompts left-padded."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=False, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, pad_token_id=0)


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def end_to_end(args: argparse.Namespace, copy_bw: float) -> dict:
    results = {}
    for key in args.models.split(","):
        folder = random_llama(key, args.model_cache)
        work = make_workload(args.seed, args.num_requests, 160.0, 340.0, 0.8, args.max_model_len, TOKENIZER_VOCAB)
        print(f"  {key}: runtime ...", flush=True)
        runtime = run_runtime(folder, work, args.max_model_len)
        print(f"  {key}: transformers ...", flush=True)
        hf = run_transformers(folder, work, args.hf_batch_size, args.hf_batches)
        floor_ms = 1e3 * weight_bytes(folder) / copy_bw
        results[key] = {"weight_bytes": weight_bytes(folder), "floor_step_ms": floor_ms, "runtime": runtime,
                        "transformers": hf, "batch1_step_vs_floor": runtime["batch1_step_ms"] / floor_ms,
                        "vs_transformers": runtime["tok_s"] / hf["tok_s"]}
    return results


# ---- reporting ------------------------------------------------------------------------
def print_attention(rows: list[dict], copy_bw: float) -> None:
    print(f"\ndecode attention (bf16, 32 q / 8 KV heads, head dim 128, block 16); copy {copy_bw / 1e9:.0f} GB/s")
    header = (f"{'batch':>6}{'context':>9}{'splits':>7}{'triton us':>11}{'GB/s':>8}{'of copy':>9}"
              f"{'sdpa us':>10}{'GB/s':>8}{'of copy':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['batch']:>6}{r['context']:>9}{r['splits']:>7}{r['triton_us']:>11.1f}{r['triton_gb_s']:>8.0f}"
              f"{r['triton_copy_share']:>9.0%}{r['sdpa_us']:>10.1f}{r['sdpa_gb_s']:>8.0f}{r['sdpa_copy_share']:>9.0%}")


def print_e2e(results: dict) -> None:
    print("\nend to end (random weights, bf16)")
    header = (f"{'model':<6}{'b1 step ms':>11}{'eager ms':>9}{'floor ms':>10}{'ratio':>7}{'runtime tok/s':>15}"
              f"{'HF tok/s':>10}{'x HF':>7}")
    print(header)
    print("-" * len(header))
    for key, r in results.items():
        print(f"{key:<6}{r['runtime']['batch1_step_ms']:>11.2f}{r['runtime']['batch1_step_ms_eager']:>9.2f}"
              f"{r['floor_step_ms']:>10.2f}"
              f"{r['batch1_step_vs_floor']:>7.2f}{r['runtime']['tok_s']:>15.0f}{r['transformers']['tok_s']:>10.0f}"
              f"{r['vs_transformers']:>7.1f}")


def verdicts(rows: list[dict], e2e: dict) -> dict:
    out = {}
    long_rows = [r for r in rows if r["context"] >= LONG_CONTEXT]
    if long_rows:
        worst = min(r["triton_copy_share"] for r in long_rows)
        target = TARGETS["decode_attention_copy_share"]
        out["decode_attention_copy_share_min_at_4k+"] = {"value": worst, "target": f">= {target}",
                                                         "met": worst >= target}
    for key, r in e2e.items():
        out[f"{key}_batch1_step_vs_floor"] = {"value": r["batch1_step_vs_floor"],
                                              "target": f"<= {TARGETS['batch1_step_vs_floor']}",
                                              "met": r["batch1_step_vs_floor"] <= TARGETS["batch1_step_vs_floor"]}
        out[f"{key}_vs_transformers"] = {"value": r["vs_transformers"], "target": f">= {TARGETS['vs_transformers']}",
                                         "met": r["vs_transformers"] >= TARGETS["vs_transformers"]}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py measures GPU kernels and needs a CUDA device; none is available here. "
              "(The kernels' correctness tests run on CPU: pytest tests/kernels.)", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name()
    print(f"device: {card}", flush=True)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = [] if args.skip_attention else decode_attention(
        [int(c) for c in args.contexts.split(",")], [int(b) for b in args.batches.split(",")], args.kv_gib, copy_bw)
    e2e = {} if args.skip_e2e else end_to_end(args, copy_bw)
    if rows:
        print_attention(rows, copy_bw)
    if e2e:
        print_e2e(e2e)
    checks = verdicts(rows, e2e)
    for name, c in checks.items():
        print(f"{name:<42}{c['value']:>8.2f}   target {c['target']:<8} {'met' if c['met'] else 'NOT met'}")
    path = args.out or result_path("kernels")
    record = {"card": card, "machine": machine_info(), "parameters": {k: str(v) for k, v in vars(args).items()},
              "copy_bandwidth_bytes_s": copy_bw, "decode_attention": rows, "end_to_end": e2e, "verdicts": checks}
    print(write_results(path, record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
