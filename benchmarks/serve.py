"""Online serving benchmark: a streaming load generator against any OpenAI-compatible /v1/completions.

What it measures (the definitions of ``vllm bench serve``)
    Each request streams (``stream: true`` with ``include_usage``). For one request:
    TTFT   send -> first chunk that carries a choice;
    ITL    the gaps between consecutive choice chunks (pooled over all requests);
    TPOT   (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
    E2EL   send -> end of the stream.
    Output tokens are the server's ``usage.completion_tokens`` (the number of chunks if it sends none).
    Request throughput = completed requests / wall seconds of the run; output token throughput =
    output tokens / wall seconds. Each statistic is reported as mean, median and p99.

Workload
    The same as benchmarks/throughput.py (make_workload in benchmarks/common.py), same seed: prompt and
    output lengths drawn from lognormal distributions (mean prompt ~160 tokens, mean output ~340, sigma
    0.8, long tails), capped so that prompt + output <= --max-model-len; prompts are random token ids
    (special ids excluded), sent as token-id prompts; greedy, with ``ignore_eos`` (a vLLM extra field) so
    every request produces exactly its drawn output length.

Arrivals
    ``--request-rate R``: Poisson arrivals (exponential gaps, seeded) at R requests/s; ``inf`` (default)
    sends all at once. ``--max-concurrency`` bounds requests in flight; several values run one after
    another (with ``--num-requests`` one value for all, or one per concurrency).

How to run
    make serve                          # in one shell: paged-runtime on 127.0.0.1:8000
    .venv/bin/python benchmarks/serve.py --max-concurrency 1 8 32 64 --num-requests 4 16 48 64
    .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8000 --request-rate 2 --num-requests 50

Writes benchmarks/results/serve[-<label>]-<device>.json (and a PNG if matplotlib is installed): ``--label``
says what was served (e.g. smollm2), ``--device`` where (default: this machine's, cpu or the GPU's name).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (FIRST_ORDINARY_ID, Request, args_dict, describe, machine_info,  # noqa: E402
                               make_workload, result_path, write_results)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


# ---- arguments and workload ----------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (or OPENAI_API_KEY)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[8], help="one run per value")
    p.add_argument("--num-requests", type=int, nargs="+", default=[32], help="one value, or one per concurrency")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--prompt-mean", type=float, default=160.0)
    p.add_argument("--output-mean", type=float, default=340.0)
    p.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of both lengths")
    p.add_argument("--max-model-len", type=int, default=2048, help="cap on prompt + output")
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    p.add_argument("--warmup", type=int, default=1, help="short requests sent before each run, not measured")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--label", default=None, help="what is served, for the file name (e.g. smollm2)")
    p.add_argument("--device", default=None, help="the server's device, for the file name (default: this machine's)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/serve[-<label>]-<device>.json)")
    args = p.parse_args(argv)
    if len(args.num_requests) not in (1, len(args.max_concurrency)):
        p.error("--num-requests takes one value or one per --max-concurrency value")
    return args


def arrival_gaps(args: argparse.Namespace, n: int) -> np.ndarray:
    if args.request_rate == float("inf"):
        return np.zeros(n)
    return np.random.default_rng(args.seed + 1).exponential(1.0 / args.request_rate, n)


# ---- one request ------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, model: str, request: Request) -> RequestResult:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_len=len(request.prompt))
    start = last = time.perf_counter()
    num_chunks, usage_tokens = 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                now = time.perf_counter()
                if chunk.get("choices"):
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    num_chunks, last = num_chunks + 1, now
                elif chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                elif chunk.get("error"):
                    result.error = chunk["error"].get("message")
                    return result
        result.e2el = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        result.ok = num_chunks > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_level(args: argparse.Namespace, client: httpx.AsyncClient, model: str, work: list[Request],
                    concurrency: int) -> tuple[list[RequestResult], float]:
    """All of ``work`` with at most ``concurrency`` in flight; returns results and wall seconds."""
    limit = asyncio.Semaphore(concurrency)

    async def limited(request: Request) -> RequestResult:
        async with limit:
            return await send(client, model, request)

    tasks = []
    start = time.perf_counter()
    for request, gap in zip(work, arrival_gaps(args, len(work))):
        if gap:
            await asyncio.sleep(float(gap))
        tasks.append(asyncio.create_task(limited(request)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def warm_up(args: argparse.Namespace, client: httpx.AsyncClient, model: str) -> None:
    rng = np.random.default_rng(args.seed + 2)
    for _ in range(args.warmup):
        prompt = rng.integers(FIRST_ORDINARY_ID, args.vocab_size, 16).tolist()
        result = await send(client, model, Request(prompt, 8))
        if not result.ok:
            raise SystemExit(f"warm-up request failed: {result.error}")


async def resolve_model(args: argparse.Namespace, client: httpx.AsyncClient) -> str:
    if args.model:
        return args.model
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# ---- statistics --------------------------------------------------------------------------------
def ms(seconds: list[float]) -> dict:
    return describe(seconds, scale=1000.0)


def summarize(concurrency: int, results: list[RequestResult], seconds: float) -> dict:
    done = [r for r in results if r.ok]
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in done)
    return {"max_concurrency": concurrency, "requests": len(results), "completed": len(done),
            "failed": len(results) - len(done), "errors": sorted({r.error for r in results if r.error})[:5],
            "seconds": seconds, "prompt_tokens": sum(r.prompt_len for r in done), "output_tokens": output_tokens,
            "request_throughput": len(done) / seconds, "output_throughput": output_tokens / seconds,
            "total_token_throughput": (output_tokens + sum(r.prompt_len for r in done)) / seconds,
            "ttft_ms": ms([r.ttft for r in done]), "tpot_ms": ms(tpot),
            "itl_ms": ms([gap for r in done for gap in r.itl]), "e2el_ms": ms([r.e2el for r in done])}


COLUMNS = [("conc", "max_concurrency", "{:d}"), ("reqs", "completed", "{:d}"), ("s", "seconds", "{:.1f}"),
           ("req/s", "request_throughput", "{:.2f}"), ("out tok/s", "output_throughput", "{:.1f}")]
LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms")]


def table_rows(levels: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = [c[0] for c in COLUMNS] + [f"{name} {stat}" for name, _ in LATENCIES for stat in ("mean", "med", "p99")]
    rows = []
    for level in levels:
        row = [fmt.format(level[key]) for _, key, fmt in COLUMNS]
        for _, key in LATENCIES:
            row += ["-" if level[key][s] is None else f"{level[key][s]:.0f}" for s in ("mean", "median", "p99")]
        rows.append(row)
    return header, rows


def print_table(levels: list[dict]) -> None:
    header, rows = table_rows(levels)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("latencies in ms")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def draw(plt, levels: list[dict]):
    x = [level["max_concurrency"] for level in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(x, [level["output_throughput"] for level in levels], marker="o")
    left.set(xlabel="max concurrency", ylabel="output tokens / s", xscale="log", title="throughput")
    for name, key in LATENCIES[:3]:
        right.plot(x, [level[key]["median"] for level in levels], marker="o", label=f"{name} median")
    right.set(xlabel="max concurrency", ylabel="ms", xscale="log", yscale="log", title="latency")
    right.legend()
    return fig


# ---- main ----------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.max_concurrency) + 8, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits, timeout=timeout) as client:
        model = await resolve_model(args, client)
        levels = []
        for i, concurrency in enumerate(args.max_concurrency):
            num_requests = args.num_requests[min(i, len(args.num_requests) - 1)]
            work = make_workload(args.seed, num_requests, args.prompt_mean, args.output_mean, args.sigma,
                                 args.max_model_len, args.vocab_size)
            await warm_up(args, client, model)
            print(f"max concurrency {concurrency}: {num_requests} requests, "
                  f"{sum(r.output_len for r in work)} output tokens ...", flush=True)
            results, seconds = await run_level(args, client, model, work, concurrency)
            levels.append(summarize(concurrency, results, seconds))
            if levels[-1]["failed"]:
                print(f"  {levels[-1]['failed']} failed: {levels[-1]['errors']}", flush=True)
            print(f"  {seconds:.1f} s, {levels[-1]['output_throughput']:.1f} output tok/s", flush=True)
    return {"model": model, "levels": levels}


def main(argv=None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    report = asyncio.run(run(args))
    print()
    print_table(report["levels"])
    out = args.out or result_path("serve", args.label, device=args.device)
    params = {k: v for k, v in args_dict(args).items() if k != "api_key"}
    params["request_rate"] = str(args.request_rate)
    machine = machine_info() | {"load_average_1m": {"start": load, "end": os.getloadavg()[0]}}
    print("\n" + write_results(out, {"machine": machine, "parameters": params, **report}, draw, report["levels"]))
    return 0 if all(level["failed"] == 0 for level in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
