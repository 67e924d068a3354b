"""What the benchmark scripts share: the workload, the machine, the busy-cores check, summary statistics and
where results go.

Scripts import it as ``from benchmarks.common import ...`` (benchmarks/README.md says how a script run as a
file finds the package). Only numpy is imported here up front: torch, transformers, matplotlib and
paged_runtime are imported by the functions that need them, so the HTTP-only scripts (serve.py, soak.py)
stay light.

Results are ``benchmarks/results/<bench>-<device>.json`` (and ``.png``): ``bench`` is the script's name, or
the script's name and one short qualifier saying what was measured (``throughput-mixed``); ``device`` is
``cpu`` or the GPU's short name (``h200``, ``h100``). See ``result_path``.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BUSY_LIMIT = 0.3  # cores busy with other work above which a figure is flagged as distorted
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# /proc/cpuinfo flags that decide which CPU kernels run (recorded in every machine_info)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


# ---- the workload -------------------------------------------------------------------------------------
# The ShareGPT-like workload every benchmark draws from. Prompt and output lengths are lognormal (long tails)
# with the given means, prompts are capped at half the model length and outputs so that prompt + output
# fits; prompts are random ordinary token ids. The same seed gives the same requests in every script, so
# offline and served figures compare.
FIRST_ORDINARY_ID = 3  # SmolLM2's special tokens are ids 0..2


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """Integer lengths >= 1 whose (uncapped) mean is ``mean``."""
    mu = np.log(mean) - sigma ** 2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(int)


def make_workload(seed: int, n: int, prompt_mean: float, output_mean: float, sigma: float, max_model_len: int,
                  vocab_size: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.minimum(lognormal_lengths(rng, prompt_mean, sigma, n), max_model_len // 2)
    output_lens = np.minimum(lognormal_lengths(rng, output_mean, sigma, n), max_model_len - prompt_lens)
    return [Request(rng.integers(FIRST_ORDINARY_ID, vocab_size, int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens)]


def add_round_args(p, num_requests: int, output_mean: float, prompt_mean: float, decode_tokens: int,
                   rounds: int) -> None:
    """The flags of a script that measures, round after round, the mixed workload and a batch-1 decode
    (async_scheduling.py, parallel.py, quantization.py); the defaults are the script's."""
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--output-mean", type=float, default=output_mean)
    p.add_argument("--prompt-mean", type=float, default=prompt_mean)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--decode-tokens", type=int, default=decode_tokens)
    p.add_argument("--rounds", type=int, default=rounds)


def round_workload(args, vocab_size: int) -> tuple[list[Request], list[int]]:
    """For add_round_args's flags (and ``--max-model-len``): the mixed workload (seed 0) and the 32-token prompt
    of the batch-1 decode (seed 1)."""
    workload = make_workload(0, args.num_requests, args.prompt_mean, args.output_mean, args.sigma,
                             args.max_model_len, vocab_size)
    return workload, make_workload(1, 1, 32, 1, 0.1, args.max_model_len, vocab_size)[0].prompt


# ---- the machine --------------------------------------------------------------------------------------
def machine_info() -> dict:
    """Where a figure was measured: CPU model and ISA flags, cores, versions, the GPU if any, the commit, and the
    compiled CPU kernels this process loaded (``kernels/cpu.info()``: their ISA and each family's path; None
    where none are loaded)."""
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "git": git_revision(),
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        import torch
    except ImportError:  # a load generator's machine may have no torch
        return info | {"torch": None, "device": "cpu", "gpu": None}
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    kernels = sys.modules.get("paged_runtime.kernels.cpu")  # never imported: never loaded
    return info | {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                   "transformers": transformers_version, "device": "cuda" if torch.cuda.is_available() else "cpu",
                   "gpu": gpu_name(), "cpu_kernels": kernels.info() if kernels else None}


def cpu_model() -> str | None:
    return _cpuinfo_field("model name")


def cpu_flags() -> list[str] | None:
    """The ISA_FLAGS this CPU has (None where /proc/cpuinfo cannot be read)."""
    flags = _cpuinfo_field("flags")
    return None if flags is None else [f for f in ISA_FLAGS if f in set(flags.split())]


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), None)
    except OSError:
        return None


def gpu_name() -> str | None:
    """The CUDA (or ROCm) device's name, e.g. "NVIDIA H200"; None without one."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def device_name() -> str:
    """The ``<device>`` of a result's name: ``cpu``, or the GPU's model in lower case ("NVIDIA H200" -> h200,
    "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA GeForce RTX 4090" -> rtx4090)."""
    name = gpu_name()
    if name is None:
        return "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower())
             if w and w not in ("nvidia", "tesla", "geforce", "amd", "instinct", "radeon")]
    if not words:
        return "gpu"
    return words[0] + words[1] if len(words) > 1 and not re.search(r"\d", words[0]) else words[0]


def git_revision() -> dict | None:
    """Commit of the measured checkout, and whether paged_runtime/ had uncommitted changes."""
    try:
        run = lambda *cmd: subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                          check=True).stdout.strip()
        return {"commit": run("rev-parse", "HEAD"),
                "paged_runtime_dirty": bool(run("status", "--porcelain", "--", "paged_runtime"))}
    except (OSError, subprocess.CalledProcessError):
        return None


def others_busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy by other processes over ``seconds`` while this one sleeps (from /proc/stat).

    torch's CPU thread pool slows down many-fold when its cores are shared, so a
    figure measured next to a busy neighbour is not comparable (see BUSY_LIMIT).
    """
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # busy (minus idle, iowait), total
    try:
        busy0, total0 = read()
        time.sleep(seconds)
        busy1, total1 = read()
    except (OSError, ValueError):
        return None
    return round((busy1 - busy0) / max(1, total1 - total0) * os.cpu_count(), 2)


# ---- statistics ---------------------------------------------------------------------------------------
def describe(values, scale: float = 1.0) -> dict:
    """Mean, median and 99th percentile (numpy's, linear between ranks) of ``values`` times ``scale``;
    None for each where there are no values."""
    if len(values) == 0:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def elapsed(fn) -> float:
    """Seconds ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- the engine and models ----------------------------------------------------------------------------
def timed_generate(llm, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    """Greedy ``ignore_eos`` generation of token-id prompts, all submitted at once: seconds, output ids."""
    from paged_runtime import SamplingParams
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def copy_tokenizer(folder: Path) -> None:
    """Copies the embedded SmolLM2's tokenizer files into a (random-weight) model folder."""
    import shutil

    from paged_runtime.models.default_model import default_model_path
    source = default_model_path()
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)


# ---- servers a benchmark starts ------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def launched_server(command: list[str], health_url: str, log: Path, env: dict | None = None,
                    timeout: float = 900.0):
    """Runs ``command`` (a server) in a process group of its own, in the folder of ``log`` (so that no package
    of this checkout shadows one of the server's), its output in ``log``, and yields the process once
    ``health_url`` answers 200; stops the whole group on the way out (SIGTERM, SIGKILL 30 s later), so a
    server's own workers (vLLM's engine core) go with it."""
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path(log).parent,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _answers(health_url):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = Path(log).read_text()[-3000:]
                raise RuntimeError(f"{command[:4]} did not come up (exit {server.poll()}); its log ends:\n{tail}")
            time.sleep(1.0)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


# ---- results ------------------------------------------------------------------------------------------
def result_path(bench: str, *what: str | None, device: str | None = None) -> Path:
    """``RESULTS/<bench>[-<what>]-<device>.json``: ``what``, the qualifier, is the parts given that are not
    None joined by "_" (throughput: "mixed", "float32" -> throughput-mixed_float32-cpu.json); ``device``
    defaults to this machine's (device_name)."""
    qualifier = "_".join(part for part in what if part)
    return RESULTS / ("-".join(filter(None, [bench, qualifier, device or device_name()])) + ".json")


def args_dict(args) -> dict:
    """An argparse namespace for JSON (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_json(path: Path, data, indent: int = 2) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path


def write_png(path: Path, draw, *args) -> Path | None:
    """``draw(plt, *args)`` makes a figure and returns it (``plt``: matplotlib.pyplot); saved at ``path``.
    None, and no file, without matplotlib (the ``bench`` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = draw(plt, *args)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(path: Path, data, draw=None, *args, indent: int = 2) -> str:
    """Writes ``data`` as JSON at ``path`` and, given ``draw`` (see write_png, which passes it ``*args``), the
    picture beside it (``.png``); returns the line to print: what was written, or why there is no picture."""
    write_json(path, data, indent)
    message = f"wrote {path}"
    if draw is not None:
        png = write_png(Path(path).with_suffix(".png"), draw, *args)
        message += f" and {png}" if png else " (no PNG: matplotlib not installed)"
    return message
