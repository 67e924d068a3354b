"""CPU decode step: the compiled kernels against the plain PyTorch path and the memory floor.

What it measures
    The embedded SmolLM2-135M-Instruct (bf16 unless --dtype). For each batch size,
    ``batch`` random prompts of ``--context`` tokens are prefilled, then
    ``--steps`` decode steps are timed (ms per step = one new token per request).
    Two engines run in the same process, interleaved for ``--rounds`` rounds, each
    keeping its fastest round: the default (compiled CPU kernels) and
    ``enforce_eager=True`` (plain PyTorch). Fresh requests each round, so every
    round decodes over the same context lengths.

    The floor is the weight bytes one step must read (every matrix once, the
    embedding table as the tied LM head) over this machine's read bandwidth, measured
    here as a 1 GiB float32 sum on all threads. The peer is transformers' own
    ``generate`` at batch 1 (ms per new token beyond the first, greedy, KV cache on).

Writes results/cpu_decode-cpu.json (cpu_decode-float32-cpu.json with ``--dtype float32``).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cpu_decode.py
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import elapsed, machine_info, others_busy_cores, result_path, write_results  # noqa: E402


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a full-thread float32 sum reads from a buffer far larger than the caches."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    buffer.sum()
    best = min(elapsed(buffer.sum) for _ in range(repeats))
    return buffer.numel() * 4 / best


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once


def decode_ms(llm, batch: int, context: int, steps: int, seed: int, max_token_id: int = 49000,
              adapters: list | None = None) -> float:
    """Milliseconds per decode step with ``batch`` requests at ``context`` random tokens (ids < max_token_id);
    ``adapters``: request i runs ``adapters[i % len(adapters)]`` (a LoRARequest, or None: the base model)."""
    from paged_runtime import SamplingParams
    engine, rng = llm.engine, random.Random(seed)
    params = SamplingParams(max_tokens=steps + 10, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    adapters = adapters or [None]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [rng.randrange(3, max_token_id) for _ in range(context)], params,
                           lora_request=adapters[i % len(adapters)])
    while any(r.num_computed_tokens < context for r in engine.core.scheduler.requests.values()):
        engine.step()
    for _ in range(2):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request(ids)
    return elapsed / steps * 1000


def hf_ms_per_token(dtype: torch.dtype, context: int, new_tokens: int = 32) -> float:
    from transformers import AutoModelForCausalLM

    from paged_runtime.models.default_model import default_model_path
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=dtype).eval()
    prompt = torch.randint(3, 49000, (1, context), generator=torch.Generator().manual_seed(0))
    generate = lambda n: model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                                        temperature=None)
    with torch.inference_mode():
        generate(2)
        one = min(elapsed(lambda: generate(1)) for _ in range(2))
        many = min(elapsed(lambda: generate(new_tokens + 1)) for _ in range(2))
    return (many - one) / new_tokens * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)
    from paged_runtime import LLM
    busy = others_busy_cores()
    common = dict(dtype=args.dtype, max_model_len=2048, kv_cache_memory=2**30, max_num_seqs=max(args.batch),
                  max_num_batched_tokens=4096)
    engines = {"kernels": LLM(cpu_kernels=True, **common), "eager": LLM(enforce_eager=True, **common)}
    assert engines["kernels"].engine.core.ops.name == "cpu-kernels", "the CPU kernels did not load (no C compiler?)"
    best: dict[str, dict[int, float]] = {name: {} for name in engines}
    for round_ in range(args.rounds):
        for batch in args.batch:
            for name, llm in engines.items():
                ms = decode_ms(llm, batch, args.context, args.steps, seed=round_)
                best[name][batch] = min(best[name].get(batch, ms), ms)
    model = engines["kernels"].engine.core.runner.model
    del engines
    bandwidth = read_bandwidth()
    floor_ms = weight_bytes(model) / bandwidth * 1000
    hf_ms = None if args.skip_hf else hf_ms_per_token(getattr(torch, args.dtype), args.context)
    rows = [{"batch": b, "kernels_ms": best["kernels"][b], "eager_ms": best["eager"][b],
             "speedup": best["eager"][b] / best["kernels"][b], "kernels_tok_s": b / best["kernels"][b] * 1000}
            for b in args.batch]
    print(f"SmolLM2-135M {args.dtype}, context {args.context}, {args.steps} steps, best of {args.rounds} rounds")
    print(f"{'batch':>5s} {'kernels ms':>11s} {'eager ms':>9s} {'speedup':>8s} {'tok/s':>7s}")
    for r in rows:
        print(f"{r['batch']:5d} {r['kernels_ms']:11.1f} {r['eager_ms']:9.1f} {r['speedup']:7.2f}x "
              f"{r['kernels_tok_s']:7.0f}")
    print(f"floor: {weight_bytes(model) / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s read = "
          f"{floor_ms:.1f} ms per step")
    if 1 in best["kernels"]:
        print(f"batch 1: kernels at {best['kernels'][1] / floor_ms:.2f}x the floor")
    if hf_ms is not None:
        print(f"transformers generate, batch 1: {hf_ms:.1f} ms per token "
              f"({hf_ms / best['kernels'].get(1, float('nan')):.1f}x the kernels' step)")
    out = result_path("cpu_decode", None if args.dtype == "bfloat16" else args.dtype, device="cpu")
    print(write_results(out, {"parameters": vars(args), "machine": machine_info(), "others_busy_cores": busy,
                              "rows": rows, "weight_bytes": weight_bytes(model), "read_bandwidth": bandwidth,
                              "floor_ms": floor_ms, "transformers_ms_per_token": hf_ms}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
