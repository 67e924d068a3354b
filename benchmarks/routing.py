"""Routing across replicas: prefix-cache hit rate and time to first token under Ray Serve, per router.

What it runs
    A local Ray cluster with the ``rayserve_adapter`` application in multi-replica mode (``--replicas``,
    default 4, ``num_cpus: 0``), once per router, each time on fresh replicas:

    power_of_two  Serve's default: the less loaded of two random replicas;
    prefix        the prefix-affinity router (what was routed where, on the prompt's text);
    kv_events     the KV-event router (what each replica's cache holds, from its KV-cache events, on the
                  prompt's token ids rendered by a replica).

Workload
    A multi-turn chat: ``--conversations`` conversations under ``--system-prompts`` shared system prompts (long,
    distinct), ``--turns`` turns each; turn t of a conversation sends its whole history (system prompt, the
    earlier user turns and the assistant's answers, as it got them) plus a new user message. Conversations
    run ``--concurrency`` at a time, each turn streamed (``max_tokens`` ``--output-tokens``, greedy); the next
    turn of a conversation starts when its previous one ended. The same seed gives the same messages.

What it measures
    hit rate   prefix-cache hits / prompt tokens looked up, summed over the replicas (their
               ``record_routing_stats``: ``vllm:prefix_cache_hits`` / ``queries``), for the workload only;
    TTFT       send -> first streamed chunk with a choice, per request: mean, median, p99;
    wall       seconds for the whole workload.
    The ratios are against power_of_two in the same run.

How to run
    .venv/bin/python benchmarks/routing.py                    # the embedded SmolLM2-135M-Instruct, 4 replicas
    .venv/bin/python benchmarks/routing.py --model DIR --replicas 2 --conversations 8

Writes benchmarks/results/routing-<device>.json and .png. Traffic goes to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import args_dict, describe, free_port, machine_info, result_path, write_results  # noqa: E402

ROUTERS = ("power_of_two", "prefix", "kv_events")
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
WORDS = ("river", "lantern", "harbour", "meadow", "signal", "archive", "copper", "orchard", "valley", "engine",
         "summit", "canvas", "thread", "beacon", "garden", "ledger", "compass", "forest", "quartz", "window")


def sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n)) + "."


def system_prompts(rng: np.random.Generator, count: int, words: int) -> list[str]:
    return [f"You are assistant number {i}. Follow these house rules carefully: " + sentence(rng, words)
            for i in range(count)]


async def converse(client: httpx.AsyncClient, model: str, system: str, questions: list[str], max_tokens: int,
                   ttfts: list[float]) -> None:
    messages = [{"role": "system", "content": system}]
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        start, first, answer = time.perf_counter(), None, []
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    first = first or time.perf_counter()
                    answer.append(chunk["choices"][0]["delta"].get("content") or "")
        ttfts.append(first - start)
        messages.append({"role": "assistant", "content": "".join(answer)})


async def run_workload(url: str, model: str, conversations: list[tuple[str, list[str]]], concurrency: int,
                       max_tokens: int) -> tuple[list[float], float]:
    ttfts: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(system: str, questions: list[str]) -> None:
            async with gate:
                await converse(client, model, system, questions, max_tokens, ttfts)

        start = time.perf_counter()
        await asyncio.gather(*(one(s, q) for s, q in conversations))
        return ttfts, time.perf_counter() - start


def replica_totals() -> tuple[int, int]:
    """(prefix-cache queries, hits) summed over the model replicas of the running application."""
    import ray
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::routing#PagedRuntimeServer#")]
    stats = [ray.get(ray.get_actor(n, namespace="serve").record_routing_stats.remote(), timeout=60) for n in names]
    return sum(s["num_prefix_queries"] for s in stats), sum(s["num_prefix_hits"] for s in stats)


def measure(router: str, args, conversations, port: int) -> dict:
    from ray import serve

    from rayserve_adapter import app
    app_args = {"served_model_name": "m", "max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory,
                "max_num_seqs": args.max_num_seqs, "num_cpus": 0, "num_replicas": args.replicas,
                "request_router": router, "routing_stats_period_s": 0.5, "disable_log_stats": True}
    if args.model:
        app_args["model"] = args.model
    serve.run(app(app_args), name="routing", route_prefix="/routing")
    try:
        before = replica_totals()
        ttfts, wall = asyncio.run(run_workload(f"http://127.0.0.1:{port}/routing", "m", conversations,
                                               args.concurrency, args.output_tokens))
        after = replica_totals()
    finally:
        serve.delete("routing")
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"router": router, "requests": len(ttfts), "prefix_queries": queries, "prefix_hits": hits,
            "hit_rate": hits / queries if queries else 0.0, "ttft_s": describe(ttfts), "wall_s": wall}


def draw(plt, rows: list[dict]):
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["router"] for r in rows]
    left.bar(names, [100 * r["hit_rate"] for r in rows])
    left.set_ylabel("prefix-cache hit rate (%)")
    right.bar(names, [1000 * r["ttft_s"]["mean"] for r in rows])
    right.set_ylabel("mean TTFT (ms)")
    fig.suptitle("routing across replicas")
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=120, help="words in each system prompt")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-memory", default="64MiB", help="per replica")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    systems = system_prompts(rng, args.system_prompts, args.system_words)
    conversations = [(systems[i % len(systems)], [sentence(rng, 12) for _ in range(args.turns)])
                     for i in range(args.conversations)]
    os.environ.update(RAY_ENV)
    import ray
    from ray import serve
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for router in args.routers:
            rows.append(measure(router, args, conversations, port))
            print(f"{router:13s} hit rate {100 * rows[-1]['hit_rate']:5.1f}%  TTFT mean "
                  f"{1000 * rows[-1]['ttft_s']['mean']:7.1f} ms  wall {rows[-1]['wall_s']:6.1f} s", flush=True)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    base = next((r for r in rows if r["router"] == "power_of_two"), None)
    print(f"\n{'router':13s} {'hit rate':>9s} {'TTFT mean':>10s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'wall s':>7s}"
          f" {'TTFT vs p2c':>11s}")
    for r in rows:
        ratio = base["ttft_s"]["mean"] / r["ttft_s"]["mean"] if base else float("nan")
        print(f"{r['router']:13s} {100 * r['hit_rate']:8.1f}% {1000 * r['ttft_s']['mean']:8.1f}ms "
              f"{1000 * r['ttft_s']['median']:7.1f}ms {1000 * r['ttft_s']['p99']:7.1f}ms {r['wall_s']:7.1f} "
              f"{ratio:10.2f}x")
    data = {"machine": machine_info(), "args": args_dict(args), "results": rows}
    print(write_results(result_path("routing"), data, draw, rows))


if __name__ == "__main__":
    main()
