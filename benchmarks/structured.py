"""Structured outputs: throughput with and without a JSON-schema constraint at batch 32, grammar compile time,
the compiled-grammar cache and the per-step mask cost.

What it measures
    The embedded SmolLM2-135M-Instruct answers ``--num-requests`` (32) chat prompts (the tokenizer's chat
    template) asking for an employee record as JSON. Prompt lengths are the mixed workload's (``common.py``,
    the same seed and lognormal lengths as ``throughput.py``): each prompt carries a background text cut to its
    drawn length. All requests are submitted at once (``--max-num-seqs`` = the batch), greedy, and the engine
    is stepped until idle. Per configuration and round:

    1. ``json``: every request constrained by one realistic schema (an object with string, integer, enum,
       boolean and array fields, strings capped by ``maxLength``, arrays by ``maxItems``, so every output
       terminates on its own); the output ends when the grammar does (EOS) or at ``--max-tokens``;
    2. ``unconstrained``: the same prompts, no constraint, ``ignore_eos`` and each request's ``max_tokens``
       set to the length its constrained output had in the first round. Both runs therefore generate the
       same number of tokens per request and run the same batch sizes step by step: the difference is what
       the constraint costs (a grammar cannot run with ``ignore_eos``: a finished grammar allows only EOS);
    3. optionally (``--kinds regex choice``) the same pair for a regex and a choice constraint.

    Configurations alternate (A B A B, ``--rounds`` times) because the machine is shared; each keeps its best
    round. Reported: output tokens / wall second (prefill included), and the median engine-step time over the
    steps in which all ``batch`` requests were decoding (batch-32 decode steps: the figure least skewed by
    output lengths or prefill). The issue's target: constrained keeps >= 90% of unconstrained throughput.

    Grammar compile: a fresh ``GrammarBackend`` compiles the schema (first compile, which also builds
    xgrammar's tokenizer info), then a second schema (compiler warm), then looks the first up again (cache
    hit). The engine's own backend counts compiles and hits over the run (``GrammarBackend.stats``): the
    processor compiles when a request is validated and the model runner asks for the same key again, so 32
    requests with one schema are 1 compile and 63 hits on the first run, 64 hits after.

    Mask cost: during the constrained runs the benchmark wraps (no engine change) the runner's
    ``GrammarMaskFiller.fill`` (run on its helper thread during the forward pass), the wait for it before
    sampling (the part on the step's critical path) and the sampler's ``apply_token_bitmask``. Separately,
    ``GrammarMaskFiller.fill`` is timed on 32 matchers at positions taken from the real outputs, and
    ``apply_token_bitmask`` on a [32, vocab] float32 logits tensor.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/structured.py
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/structured.py --num-requests 4 --max-tokens 16 --rounds 1

Writes results/structured-<device>.json and, with matplotlib (the ``bench`` extra), structured-<device>.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (BUSY_LIMIT, args_dict, machine_info, make_workload,  # noqa: E402
                               others_busy_cores, result_path, write_results)

TARGET = 0.9  # constrained / unconstrained output tok/s at batch 32

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 18, "maximum": 80},
        "role": {"type": "string", "enum": ["engineer", "designer", "manager", "analyst", "support"]},
        "email": {"type": "string", "maxLength": 40},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
        "remote": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["name", "age", "role", "email", "skills", "remote", "summary"],
    "additionalProperties": False,
}
# A second schema for the warm-compiler figure.
SCHEMA_2 = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer"},
                   "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["city", "population", "landmarks"],
}
REGEX = r"[A-Z][a-z]{1,15} [A-Z][a-z]{1,15}, (engineer|designer|manager|analyst|support), age [1-8][0-9], " \
        r"[a-z]{2,12}@example\.com\. [A-Z][a-z ,]{10,100}\."
CHOICE = ["engineer", "designer", "manager", "analyst", "support"]
TASKS = {
    "json": "Write a JSON record for the employee described below, with their name, age, role, email, a few "
            "skills, whether they work remotely and a one-sentence summary.",
    "regex": "Describe the employee below in one line: full name, role, age, email, then one sentence.",
    "choice": "Which role fits the employee described below best: engineer, designer, manager, analyst or "
              "support? Answer with the role only.",
}
BACKGROUND = (
    "Maria Lopez joined the platform team four years ago after a decade in embedded systems. She maintains the "
    "build pipeline, mentors two junior engineers and writes most of the team's Rust tooling. Colleagues describe "
    "her as patient and precise; she prefers written design reviews to meetings and works from Valencia three "
    "days a week. Last quarter she cut the nightly build time from ninety minutes to twenty-five by caching "
    "compiled dependencies and splitting the test suite across runners. She is 38, speaks Spanish, English and "
    "some German, and is known for her careful incident write-ups. Before that she led the migration of the "
    "billing service to a new database, which took eight months and finished without downtime. Her manager "
    "notes that she volunteers for on-call rotations, documents every runbook she touches and keeps a list of "
    "small fixes that nobody else has time for. Outside work she climbs, bakes bread and organises a monthly "
    "meetup for local developers interested in compilers and performance engineering. "
)


# ---- prompts and sampling ---------------------------------------------------------------------------
def make_prompts(tokenizer, kind: str, args) -> list[str]:
    """Chat prompts whose lengths follow the mixed workload's prompt lengths (the background text is cut to
    the drawn length in tokens; the template and task add a fixed ~60 tokens)."""
    work = make_workload(args.seed, args.num_requests, args.prompt_mean, 1.0, args.sigma, args.max_model_len,
                         tokenizer.vocab_size)
    text_ids = tokenizer.encode(BACKGROUND * 8, add_special_tokens=False)
    prompts = []
    for i, r in enumerate(work):
        start = (i * 37) % 200  # a different cut of the text per request
        background = tokenizer.decode(text_ids[start:start + len(r.prompt)])
        prompts.append(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{TASKS[kind]}\n\nBackground: {background}"}], tokenize=False,
            add_generation_prompt=True))
    return prompts


def constraint(kind: str):
    from paged_runtime import StructuredOutputsParams
    return {"json": lambda: StructuredOutputsParams(json=SCHEMA), "regex": lambda: StructuredOutputsParams(regex=REGEX),
            "choice": lambda: StructuredOutputsParams(choice=CHOICE)}[kind]()


def params_for(kind: str | None, max_tokens: int, seed: int):
    from paged_runtime import SamplingParams
    if kind is None:  # unconstrained: exactly max_tokens tokens
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, seed=seed)
    return SamplingParams(max_tokens=max_tokens, temperature=0, seed=seed, structured_outputs=constraint(kind))


# ---- instrumentation (wrappers around the engine's objects, no engine change) ---------------------------
class MaskTimers:
    """Times the runner's mask fill (helper thread), the wait for it before sampling and the bitmask apply."""

    def __init__(self, llm) -> None:
        import paged_runtime.sample.sampler as sampler_module
        self.fill: list[float] = []
        self.wait: list[float] = []
        self.apply: list[float] = []
        self.rows: list[int] = []
        filler = llm.engine.core.runner.grammar_masks
        fill, start, apply = filler.fill, filler.start, sampler_module.apply_token_bitmask
        timers = self

        def timed_fill(sampled, speculating):
            t = time.perf_counter()
            out = fill(sampled, speculating)
            timers.fill.append(time.perf_counter() - t)
            timers.rows.append(len(out.sample_rows) + len(out.spec_rows))
            return out

        class Waited:
            def __init__(self, future):
                self.future = future

            def result(self):
                t = time.perf_counter()
                out = self.future.result()
                timers.wait.append(time.perf_counter() - t)
                return out

        def timed_start(sampled, speculating):
            future = start(sampled, speculating)
            return None if future is None else Waited(future)

        def timed_apply(logits, rows, bitmask):
            t = time.perf_counter()
            apply(logits, rows, bitmask)
            timers.apply.append(time.perf_counter() - t)

        filler.fill, filler.start = timed_fill, timed_start
        sampler_module.apply_token_bitmask = timed_apply

    def take(self) -> dict:
        """Totals since the last call (seconds, and per constrained row per step in microseconds)."""
        rows = sum(self.rows)
        out = {"steps_with_masks": len(self.fill), "mask_rows": rows, "fill_s": sum(self.fill),
               "wait_s": sum(self.wait), "apply_s": sum(self.apply),
               "fill_us_per_row": sum(self.fill) / rows * 1e6 if rows else None,
               "wait_ms_per_step": sum(self.wait) / len(self.wait) * 1e3 if self.wait else None,
               "apply_ms_per_step": sum(self.apply) / len(self.apply) * 1e3 if self.apply else None}
        self.fill, self.wait, self.apply, self.rows = [], [], [], []
        return out


# ---- one run ----------------------------------------------------------------------------------------------
def run(llm, prompts: list[str], kind: str | None, max_tokens: list[int], name: str, timers: MaskTimers) -> dict:
    """All prompts submitted at once, the engine stepped until idle; per-step times with the batch they ran."""
    engine, core = llm.engine, llm.engine.core
    stats = engine.grammars.stats
    before = (stats.num_compiled, stats.num_hits, stats.compile_seconds)
    busy_before = others_busy_cores()
    timers.take()
    outputs: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    steps: list[tuple[float, int, bool]] = []  # (seconds, running, all decoding)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{name}-{i}", p, params_for(kind, max_tokens[i], seed=i))
    while engine.has_unfinished_requests():
        running = core.scheduler.running
        decoding = bool(running) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        n = len(running)
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                texts[out.request_id] = out.outputs[0].text
        steps.append((time.perf_counter() - t, n, decoding))
    seconds = time.perf_counter() - start
    masks = timers.take() if kind is not None else None
    ordered = [outputs[f"{name}-{i}"] for i in range(len(prompts))]
    tokens = sum(map(len, ordered))
    batch = len(prompts)
    full = [s for s, n, d in steps if n == batch and d]
    valid = None
    if kind == "json":
        valid = sum(_valid_json(texts[f"{name}-{i}"]) for i in range(batch))
    return {"config": name, "kind": kind, "requests": batch, "output_tokens": tokens, "seconds": seconds,
            "output_tok_s": tokens / seconds, "engine_steps": len(steps), "ms_per_step": seconds / len(steps) * 1e3,
            "batch_decode_steps": len(full),
            "batch_decode_step_ms": statistics.median(full) * 1e3 if full else None,
            "output_lens": [len(o) for o in ordered], "valid_outputs": valid,
            "compiles": stats.num_compiled - before[0], "cache_hits": stats.num_hits - before[1],
            "compile_s": stats.compile_seconds - before[2], "masks": masks,
            "others_busy_cores": (busy_before, others_busy_cores()),
            "sample_output": texts[f"{name}-0"], "_tokens": ordered}


def _valid_json(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["required"])


# ---- compile and mask micro-measurements --------------------------------------------------------------------
def compile_times(llm) -> dict:
    from paged_runtime import StructuredOutputsParams
    from paged_runtime.structured_output.backend import GrammarBackend
    engine = llm.engine
    vocab = engine.core.runner.model.config.vocab_size
    backend = GrammarBackend(engine.tokenizer, vocab, engine.eos_token_ids)
    timed = lambda f: (lambda t: (f(), time.perf_counter() - t)[1])(time.perf_counter())
    first = timed(lambda: backend.compile(StructuredOutputsParams(json=SCHEMA)))
    second = timed(lambda: backend.compile(StructuredOutputsParams(json=SCHEMA_2)))
    regex = timed(lambda: backend.compile(StructuredOutputsParams(regex=REGEX)))
    hits = [timed(lambda: backend.compile(StructuredOutputsParams(json=SCHEMA))) for _ in range(100)]
    return {"first_compile_ms (with tokenizer info)": first * 1e3, "second_schema_compile_ms": second * 1e3,
            "regex_compile_ms": regex * 1e3, "cache_hit_us": statistics.median(hits) * 1e6}


def mask_micro(llm, prompts_tokens: list[list[int]], outputs: list[list[int]], repeats: int) -> dict:
    """GrammarMaskFiller.fill over len(outputs) matchers at several positions of the real outputs, and
    apply_token_bitmask on [rows, vocab] float32 logits."""
    from paged_runtime import StructuredOutputsParams
    from paged_runtime.sample.sampler import apply_token_bitmask
    from paged_runtime.structured_output.grammar import RequestGrammar
    from paged_runtime.worker.grammar_masks import GrammarMaskFiller
    backend = llm.engine.grammars
    vocab = llm.engine.core.runner.model.config.vocab_size
    compiled = backend.compile(StructuredOutputsParams(json=SCHEMA))
    filler = GrammarMaskFiller(vocab)
    per_row = {}
    for fraction in (0.0, 0.25, 0.5, 0.75):
        requests = []
        for prompt, out in zip(prompts_tokens, outputs):
            k = min(int(len(out) * fraction), max(0, len(out) - 2))  # stay before the final EOS
            requests.append(SimpleNamespace(grammar=RequestGrammar(backend.matcher(compiled)),
                                            token_ids=prompt + out[:k], num_prompt_tokens=len(prompt)))
        filler.fill(requests, [])  # syncs the matchers; later calls only fill
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            masks = filler.fill(requests, [])
            times.append(time.perf_counter() - t)
        per_row[f"{fraction:.2f}"] = min(times) / len(requests) * 1e6
    logits = torch.randn(len(outputs), vocab)
    rows = list(range(len(outputs)))
    times = []
    for _ in range(repeats):
        x = logits.clone()
        t = time.perf_counter()
        apply_token_bitmask(x, rows, masks.sample)
        times.append(time.perf_counter() - t)
    return {"rows": len(outputs), "fill_us_per_row_at_output_fraction": per_row,
            "fill_ms_per_step": statistics.mean(per_row.values()) * len(outputs) / 1e3,
            "apply_ms_per_step": min(times) * 1e3}


# ---- reporting ----------------------------------------------------------------------------------------------
HEADER = (f"{'config':<22}{'round':>6}{'out tok':>9}{'steps':>7}{'seconds':>9}{'out tok/s':>11}"
          f"{'b-decode ms':>13}{'fill us/row':>13}{'wait ms':>9}{'apply ms':>10}{'compiles/hits':>15}")


def print_row(r: dict, round_: int) -> None:
    m = r["masks"] or {}
    f = lambda v, spec: format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))
    busy = [b for b in r["others_busy_cores"] if b is not None]
    flag = f"  ! others busy {max(busy):.1f} cores" if busy and max(busy) > BUSY_LIMIT else ""
    print(f"{r['config']:<22}{round_:>6}{r['output_tokens']:>9}{r['engine_steps']:>7}{r['seconds']:>9.2f}"
          f"{r['output_tok_s']:>11.1f}{f(r['batch_decode_step_ms'], '13.1f')}{f(m.get('fill_us_per_row'), '13.1f')}"
          f"{f(m.get('wait_ms_per_step'), '9.2f')}{f(m.get('apply_ms_per_step'), '10.2f')}"
          f"{str(r['compiles']) + '/' + str(r['cache_hits']):>15}{flag}", flush=True)


def best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["output_tok_s"])


def summarize(runs: dict[str, list[dict]], kinds: list[str]) -> list[dict]:
    summary = []
    for kind in kinds:
        c, u = runs[kind], runs[f"unconstrained/{kind}"]
        bc, bu = best(c), best(u)
        step = lambda rows: min((r["batch_decode_step_ms"] for r in rows if r["batch_decode_step_ms"]), default=None)
        sc, su = step(c), step(u)
        summary.append({
            "kind": kind, "constrained_tok_s": bc["output_tok_s"], "unconstrained_tok_s": bu["output_tok_s"],
            "tok_s_ratio": bc["output_tok_s"] / bu["output_tok_s"],
            "tok_s_ratio_median_rounds": statistics.median(r["output_tok_s"] for r in c)
            / statistics.median(r["output_tok_s"] for r in u),
            "constrained_batch_step_ms": sc, "unconstrained_batch_step_ms": su,
            "step_ratio": su / sc if sc and su else None,
            "target": TARGET, "met": bc["output_tok_s"] / bu["output_tok_s"] >= TARGET})
    return summary


def draw(plt, summary: list[dict], title: str):
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = range(len(summary))
    w = 0.38
    for ax, key, label in ((a, "tok_s", "output tokens / s (best round)"),
                           (b, "batch_step_ms", "batch-32 decode step ms (best round)")):
        un = [s[f"unconstrained_{key}"] or 0 for s in summary]
        co = [s[f"constrained_{key}"] or 0 for s in summary]
        ax.bar([i - w / 2 for i in x], un, w, label="unconstrained")
        ax.bar([i + w / 2 for i in x], co, w, label="constrained")
        ax.set_xticks(list(x), [s["kind"] for s in summary])
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig


# ---- main ---------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=32, help="the batch: all submitted at once")
    p.add_argument("--kinds", nargs="+", default=["json"], choices=["json", "regex", "choice"])
    p.add_argument("--max-tokens", type=int, default=200, help="cap on constrained outputs")
    p.add_argument("--rounds", type=int, default=2, help="A B rounds per kind; each configuration keeps its best")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                   help="float32 by default: without AVX-512 bf16 matmuls are slower on CPU")
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompt lengths)")
    p.add_argument("--prompt-mean", type=float, default=160.0)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--mask-repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from paged_runtime import LLM
    wall = time.perf_counter()
    busy = others_busy_cores()
    out = args.out or result_path("structured")
    if busy is not None and busy > BUSY_LIMIT:
        print(f"warning: other processes keep {busy:.1f} cores busy; figures will be distorted", flush=True)

    llm = LLM(model=None, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=int(args.kv_cache_gib * 2**30),
              enable_prefix_caching=False, seed=0)
    tokenizer = llm.get_tokenizer()
    machine = machine_info() | {"dtype": args.dtype, "ops": llm.engine.core.ops.name}
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, torch {machine['torch']}, "
          f"{args.dtype}, ops {machine['ops']}", flush=True)

    compile_ms = compile_times(llm)
    print("grammar compile (fresh backend): " + ", ".join(f"{k} {v:.2f}" for k, v in compile_ms.items()), flush=True)

    timers = MaskTimers(llm)
    # Warm-up: a few short requests of each configuration (also compiles the schema in the engine's backend,
    # so the rounds below see the cache; the warm-up's compile is reported as the engine's first compile).
    warm = {}
    for kind in args.kinds:
        warm[kind] = run(llm, make_prompts(tokenizer, kind, args)[:4], kind, [8] * 4, f"warm-{kind}", timers)
        run(llm, make_prompts(tokenizer, kind, args)[:4], None, [8] * 4, f"warm-u-{kind}", timers)
    print(f"engine backend warm-up: " + ", ".join(f"{k}: {w['compiles']} compile(s) in {w['compile_s'] * 1e3:.1f} ms"
                                                  for k, w in warm.items()), flush=True)

    runs: dict[str, list[dict]] = {}
    print()
    print(HEADER)
    print("-" * len(HEADER))
    lens: dict[str, list[int]] = {}
    for kind in args.kinds:
        prompts = make_prompts(tokenizer, kind, args)
        for round_ in range(args.rounds):
            c = run(llm, prompts, kind, [args.max_tokens] * len(prompts), kind, timers)
            runs.setdefault(kind, []).append(c)
            print_row(c, round_)
            lens.setdefault(kind, c["output_lens"])
            u = run(llm, prompts, None, lens[kind], f"unconstrained/{kind}", timers)
            runs.setdefault(f"unconstrained/{kind}", []).append(u)
            print_row(u, round_)
            if round_ and c["output_lens"] != lens[kind]:
                print(f"  note: {kind} output lengths differ from round 0's", flush=True)
    summary = summarize(runs, args.kinds)

    json_runs = runs.get("json")
    micro = None
    if json_runs:
        prompts_tokens = [tokenizer.encode(p, add_special_tokens=False) for p in make_prompts(tokenizer, "json", args)]
        micro = mask_micro(llm, prompts_tokens, json_runs[0]["_tokens"], args.mask_repeats)

    print()
    print(f"{'kind':<8}{'constrained tok/s':>19}{'unconstrained tok/s':>21}{'ratio':>8}{'median-round ratio':>20}"
          f"{'step ms c/u':>15}{'target':>8}")
    for s in summary:
        steps = (f"{s['constrained_batch_step_ms']:.1f}/{s['unconstrained_batch_step_ms']:.1f}"
                 if s["constrained_batch_step_ms"] and s["unconstrained_batch_step_ms"] else "-")
        print(f"{s['kind']:<8}{s['constrained_tok_s']:>19.1f}{s['unconstrained_tok_s']:>21.1f}{s['tok_s_ratio']:>8.1%}"
              f"{s['tok_s_ratio_median_rounds']:>20.1%}{steps:>15}{'met' if s['met'] else 'NOT met':>8}")
    stats = llm.engine.grammars.stats
    constrained = [r for k in args.kinds for r in runs[k]]
    hits = sum(r["cache_hits"] for r in constrained)
    compiles = sum(r["compiles"] for r in constrained)
    print(f"engine grammar cache over the measured runs: {compiles} compiles, {hits} hits "
          f"({hits / max(1, hits + compiles):.1%} hit rate); whole process: {stats.num_compiled} compiles "
          f"({stats.compile_seconds * 1e3:.1f} ms), {stats.num_hits} hits")
    if json_runs:
        valid = [r["valid_outputs"] for r in json_runs]
        print(f"json outputs parsing with every required key: {valid} of {args.num_requests} per round")
    if micro:
        print("mask micro-benchmark (json, 32 matchers): fill us/row at output fraction "
              + ", ".join(f"{k}: {v:.1f}" for k, v in micro["fill_us_per_row_at_output_fraction"].items())
              + f"; fill {micro['fill_ms_per_step']:.2f} ms / step, apply {micro['apply_ms_per_step']:.2f} ms / step")

    for rows in runs.values():
        for r in rows:
            r.pop("_tokens")
    report = {"machine": machine, "parameters": args_dict(args),
              "others_busy_cores_at_start": busy, "schema": SCHEMA, "regex": REGEX, "choice": CHOICE,
              "compile_ms": compile_ms, "engine_warmup_compile": {k: w["compile_s"] * 1e3 for k, w in warm.items()},
              "engine_grammar_stats": {"num_compiled": stats.num_compiled, "num_hits": stats.num_hits,
                                       "compile_seconds": stats.compile_seconds},
              "measured_cache": {"compiles": compiles, "hits": hits}, "mask_micro": micro,
              "summary": summary, "runs": runs, "wall_seconds": time.perf_counter() - wall}
    title = f"structured outputs, batch {args.num_requests}, SmolLM2-135M {args.dtype}, {machine['cpu_model']}"
    print("\n" + write_results(out, report, draw, summary, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
