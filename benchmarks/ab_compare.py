"""A/B speed check: two checkouts of the runtime, measured alternately in one run.

What it measures
    ``--base`` (a git ref, default e47d064, or a directory) against ``--new``
    (default: the working tree this script sits in; a ref gets its own worktree).
    A ref is checked out detached with ``git worktree add`` under a temp dir and
    removed at the end.

    For each of ``--rounds`` rounds, every measured command runs once for base and
    once for new, each in a fresh subprocess of the same python (this venv's),
    with ``PYTHONPATH`` = that tree, cwd = that tree and ``HF_HUB_OFFLINE=1``;
    which side goes first alternates from round to round to cancel drift. Each
    subprocess prints the ``paged_runtime.__file__`` it imported and the run is
    refused if that is not inside its tree (the venv's editable install must not
    shadow ``PYTHONPATH``).

    Measured commands (each tree's own copy of the script unless ``--scripts``):
      * ``benchmarks/cpu_decode.py --batch 1 8 64 --skip-hf``: ms per decode step
        of the compiled-kernel engine (the script also times its enforce_eager
        engine, there is no flag to skip it; that figure is ignored here);
      * ``benchmarks/throughput.py --skip-hf`` (``make bench`` without the
        transformers baselines): paged_runtime output tokens per second;
      * with ``--attention``, ``benchmarks/cpu_attention.py``: ms per call of the
        decode attention kernel for each cache kind and batch x context it times
        (the cache in memory; its SDPA peer is ignored here).
    Each script's JSON is redirected to a temp dir (the checked-in results are
    never touched). Each side keeps its best round; the ratio is oriented so that
    > 1 means new is faster (base ms / new ms, new tok/s / base tok/s). A metric
    only one side's script measures (a shape a newer script adds) is listed
    apart with that side's best, not compared. ``$PAGED_RUNTIME_CPU_ISA`` (kept
    in the JSON's parameters) builds both sides' kernels for that ISA (a base
    older than 7a24e26 ignores it and builds for this CPU).

Writes benchmarks/results/ab_compare-<device>.json and ab_compare-<device>.png (if
matplotlib is installed).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ab_compare.py            # full: e47d064 vs working tree
    .venv/bin/python benchmarks/ab_compare.py --new e47d064 --rounds 1 \\
        --num-requests 8 --decode-steps 4 --decode-context 64               # smoke test, ratios ~1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ != "benchmarks": sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a file
from benchmarks.common import BUSY_LIMIT, ROOT, args_dict, machine_info, result_path, write_results  # noqa: E402

DEFAULT_BASE = "e47d064"
TOLERANCE = 0.05  # issue 14: "within 5%"

# Runs one benchmark script file of one tree: prints the imported package, loads the script (which finds its
# own tree's helpers: benchmarks/common.py, or in older trees its sibling modules), redirects its results
# folder (cpu_decode.py has no --out; older scripts hold it in their own RESULTS, newer ones in
# benchmarks.common's), then calls its main(argv) (a main without parameters reads sys.argv).
DRIVER = r"""
import inspect, json, runpy, sys
from pathlib import Path
tree, script, out_dir = sys.argv[1:4]
argv = sys.argv[4:]
import paged_runtime
print("AB_IMPORT " + json.dumps({"paged_runtime": paged_runtime.__file__}), flush=True)
if not Path(paged_runtime.__file__).resolve().is_relative_to(Path(tree).resolve()):
    sys.exit(f"paged_runtime imported from {paged_runtime.__file__}, not from {tree}")
main = runpy.run_path(script, run_name="ab_compare_script")["main"]
if "RESULTS" in main.__globals__:
    main.__globals__["RESULTS"] = Path(out_dir)
if "benchmarks.common" in sys.modules:
    sys.modules["benchmarks.common"].RESULTS = Path(out_dir)
sys.argv = [script, *argv]
sys.exit(main(argv) if inspect.signature(main).parameters else main())
"""


# ---- trees ---------------------------------------------------------------------------
def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


class Tree:
    """A checkout to measure: an existing directory, or a ref checked out into a temp worktree."""

    def __init__(self, label: str, spec: str | None, tmp: Path) -> None:
        self.label, self.worktree = label, False
        if spec is None or (Path(spec).is_dir() and (Path(spec) / "paged_runtime").is_dir()):
            self.path = Path(spec or ROOT).resolve()
            self.desc = f"{self.path} (working tree at {git('rev-parse', '--short', 'HEAD', cwd=self.path)}"
            dirty = git("status", "--porcelain", "--", "paged_runtime", cwd=self.path)
            self.desc += ", paged_runtime/ modified)" if dirty else ")"
            self.commit = git("rev-parse", "HEAD", cwd=self.path)
        else:
            self.commit = git("rev-parse", "--verify", f"{spec}^{{commit}}")
            self.path = tmp / label
            git("worktree", "add", "--detach", str(self.path), self.commit)
            self.worktree = True
            self.desc = f"{spec} = {self.commit[:12]} (worktree {self.path})"

    def remove(self) -> None:
        if self.worktree and self.path.exists():
            try:
                git("worktree", "remove", "--force", str(self.path))
            except subprocess.CalledProcessError as e:
                print(f"warning: could not remove worktree {self.path}: {e.stderr.strip()}", file=sys.stderr)


# ---- measured commands -----------------------------------------------------------------
class Command:
    """One benchmark script, its arguments, and how to read its figures."""

    def __init__(self, name: str, script: str, argv: list[str]) -> None:
        self.name, self.script, self.argv = name, script, argv

    def metrics(self, out_dir: Path, stdout: str) -> dict[str, float]:
        raise NotImplementedError


class CpuDecode(Command):
    def metrics(self, out_dir: Path, stdout: str) -> dict[str, float]:
        files = sorted(out_dir.glob("cpu[-_]decode-*.json"))  # older trees: cpu-decode-<dtype>.json
        if files:
            rows = json.loads(files[0].read_text())["rows"]
            pairs = [(r["batch"], r["kernels_ms"]) for r in rows]
        else:  # a script without a RESULTS global: read its printed table
            pairs = [(int(m[1]), float(m[2])) for m in re.finditer(r"^\s*(\d+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+x",
                                                                    stdout, re.M)]
        if not pairs:
            raise RuntimeError("no decode figures found in cpu_decode.py's output")
        return {f"cpu_decode b{b} ms/step": ms for b, ms in pairs}


class Throughput(Command):
    def metrics(self, out_dir: Path, stdout: str) -> dict[str, float]:
        report = json.loads((out_dir / f"{self.script}.json").read_text())
        runtime = next(r for r in report["results"] if r["system"] == "paged_runtime")
        return {"throughput tok/s": runtime["output_tok_s"]}


class CpuAttention(Command):
    def metrics(self, out_dir: Path, stdout: str) -> dict[str, float]:
        rows = json.loads((out_dir / f"{self.script}.json").read_text())["rows"]
        return {f"attention {r['cache']} {r['batch']}x{r['context']} ms/call": r["ms"] for r in rows}


def higher_is_better(metric: str) -> bool:
    return not metric.endswith(("ms/step", "ms/call"))


def commands(args: argparse.Namespace) -> list[Command]:
    out: list[Command] = []
    if not args.skip_decode:
        argv = ["--batch", *map(str, args.batch), "--skip-hf", "--rounds", str(args.decode_rounds)]
        if args.decode_steps is not None:
            argv += ["--steps", str(args.decode_steps)]
        if args.decode_context is not None:
            argv += ["--context", str(args.decode_context)]
        out.append(CpuDecode("cpu_decode", "cpu_decode", argv + ["--dtype", args.dtype]
                             + shlex.split(args.decode_args)))
    if not args.skip_throughput:
        argv = ["--skip-hf", "--dtype", args.dtype]
        if args.num_requests is not None:
            argv += ["--num-requests", str(args.num_requests)]
        out.append(Throughput("throughput", "throughput", argv + shlex.split(args.throughput_args)))
    if args.attention:
        out.append(CpuAttention("attention", "cpu_attention", ["--repeats", str(args.attention_repeats)]))
    return out


def run_one(cmd: Command, tree: Tree, scripts: Path, tmp: Path, tag: str, python: str, verbose: bool,
            threads: int = 0) -> dict:
    """One fresh subprocess: ``cmd`` on ``tree``. Returns its metrics, import path and wall time."""
    out_dir = tmp / "out" / tag
    out_dir.mkdir(parents=True)
    argv = list(cmd.argv)
    if isinstance(cmd, (Throughput, CpuAttention)):
        argv += ["--out", str(out_dir / f"{cmd.script}.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    env.update(PYTHONPATH=str(tree.path), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if threads:  # torch reads OMP_NUM_THREADS for its intra-op pool; same for both scripts and both sides
        env.update(OMP_NUM_THREADS=str(threads))
    full = [python, "-c", DRIVER, str(tree.path), str(scripts / f"{cmd.script}.py"), str(out_dir), *argv]
    start = time.perf_counter()
    proc = subprocess.run(full, cwd=tree.path, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (out_dir / "stdout.txt").write_text(proc.stdout)
    (out_dir / "stderr.txt").write_text(proc.stderr)
    if verbose:
        print(proc.stdout)
    if proc.returncode:
        raise RuntimeError(f"{cmd.name} on {tree.label} failed (rc {proc.returncode}):\n"
                           f"{shlex.join(full[:2] + ['<driver>'] + full[3:])}\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    imported = json.loads(re.search(r"^AB_IMPORT (.*)$", proc.stdout, re.M)[1])["paged_runtime"]
    busy = None
    for f in out_dir.glob("*.json"):
        data = json.loads(f.read_text())
        if "others_busy_cores" in data:  # a figure, or (before, after) the run
            busy = data["others_busy_cores"]
            if isinstance(busy, list):
                busy = max((b for b in busy if b is not None), default=None)
        for r in data.get("results", []):
            if r.get("system") == "paged_runtime":
                busy = max((b for b in r["others_busy_cores"] if b is not None), default=None)
    return {"metrics": cmd.metrics(out_dir, proc.stdout), "paged_runtime_file": imported,
            "wall_s": round(wall, 1), "others_busy_cores": busy}


# ---- report ------------------------------------------------------------------------------
def best(values: list[float], metric: str) -> float:
    return max(values) if higher_is_better(metric) else min(values)


def ratio(base: float, new: float, metric: str) -> float:
    """> 1: new is faster."""
    return new / base if higher_is_better(metric) else base / new


def compare(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each metric both sides measured: each side's best round and their ratio; and apart, each metric only one
    side measured (its script's copy on the other side does not time it), with that side's best."""
    rows, one_sided = [], []
    for m in dict.fromkeys(k for r in runs for k in r["metrics"]):
        side = {s: [r["metrics"][m] for r in runs if r["side"] == s and m in r["metrics"]] for s in ("base", "new")}
        if not side["base"] or not side["new"]:
            only = "base" if side["base"] else "new"
            one_sided.append({"metric": m, "side": only, "best": best(side[only], m), "rounds": side[only]})
            continue
        b, n = best(side["base"], m), best(side["new"], m)
        rows.append({"metric": m, "base": b, "new": n, "new_over_base": ratio(b, n, m),
                     "higher_is_better": higher_is_better(m), "base_rounds": side["base"],
                     "new_rounds": side["new"]})
    return rows, one_sided


def draw(plt, rows: list[dict], title: str):
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.5))
    names = [r["metric"] for r in rows][::-1]
    values = [r["new_over_base"] for r in rows][::-1]
    colors = ["tab:green" if v >= 1 - TOLERANCE else "tab:red" for v in values]
    ax.barh(names, values, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(1 - TOLERANCE, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlim(min(0.8, min(values) - 0.02), max(1.2, max(values) + 0.02))
    ax.set_xlabel("new / base speed (> 1: new faster; dashed: -5%)")
    ax.set_title(title)
    return fig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base", default=DEFAULT_BASE, help="git ref (checked out in a temp worktree) or a directory")
    p.add_argument("--new", default=None, help="git ref or directory (default: this repository's working tree)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each side keeps its best")
    p.add_argument("--scripts", choices=["own", "base", "new"], default="own",
                   help="whose benchmarks/ scripts run: each tree's own, or one side's for both")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS for every run (1 is steadier on shared cores); 0 leaves torch's default")
    # cpu_decode.py
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="cpu_decode.py --batch")
    p.add_argument("--decode-rounds", type=int, default=3, help="cpu_decode.py --rounds (in-process, best kept)")
    p.add_argument("--decode-steps", type=int, default=None, help="cpu_decode.py --steps (its default: 20)")
    p.add_argument("--decode-context", type=int, default=None, help="cpu_decode.py --context (its default: 300)")
    p.add_argument("--decode-args", default="", help="more cpu_decode.py arguments, one string")
    p.add_argument("--skip-decode", action="store_true")
    # throughput.py
    p.add_argument("--num-requests", type=int, default=None, help="throughput.py --num-requests (its default: 128)")
    p.add_argument("--throughput-args", default="", help="more throughput.py arguments, one string")
    p.add_argument("--skip-throughput", action="store_true")
    # cpu_attention.py
    p.add_argument("--attention", action="store_true", help="also time the decode attention kernel (cpu_attention.py)")
    p.add_argument("--attention-repeats", type=int, default=5, help="cpu_attention.py --repeats")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/ab_compare-<device>.json)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (worktrees removed, logs kept)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every run's stdout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = args.out or result_path("ab_compare")
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="ab_compare-"))
    trees: list[Tree] = []
    try:
        trees.append(Tree("base", args.base, tmp))
        trees.append(Tree("new", args.new, tmp))
        base, new = trees
        scripts = {t.label: (t if args.scripts == "own" else base if args.scripts == "base" else new).path
                   / "benchmarks" for t in trees}
        cmds = commands(args)
        print(f"base: {base.desc}\nnew:  {new.desc}")
        for c in cmds:
            print(f"{c.name}: {c.script}.py {shlex.join(c.argv)}")
        runs: list[dict] = []
        imports: dict[str, str] = {}
        for round_ in range(args.rounds):
            order = (base, new) if round_ % 2 == 0 else (new, base)
            for cmd in cmds:
                for tree in order:
                    tag = f"r{round_}-{cmd.name}-{tree.label}"
                    res = run_one(cmd, tree, scripts[tree.label], tmp, tag, args.python, args.verbose,
                                  args.threads)
                    if tree.label not in imports:
                        imports[tree.label] = res["paged_runtime_file"]
                        print(f"  {tree.label} imports paged_runtime from {res['paged_runtime_file']}")
                    flag = (f"  ! other work kept {res['others_busy_cores']:.1f} cores busy"
                            if (res["others_busy_cores"] or 0) > BUSY_LIMIT else "")
                    figures = ", ".join(f"{k} {v:.2f}" for k, v in res["metrics"].items())
                    print(f"round {round_ + 1}/{args.rounds} {cmd.name:<10} {tree.label:<4} "
                          f"({res['wall_s']:.0f}s): {figures}{flag}", flush=True)
                    runs.append({"round": round_, "command": cmd.name, "side": tree.label} | res)

        rows, one_sided = compare(runs)
        print(f"\nbest of {args.rounds} round(s); new/base > 1 means new is faster; "
              f"issue 14 asks for >= {1 - TOLERANCE:.2f}")
        width = max([26, *(len(r["metric"]) + 2 for r in rows + one_sided)])
        header = f"{'metric':<{width}}{'base':>10}{'new':>10}{'new/base':>10}"
        print(header + "\n" + "-" * len(header))
        for r in rows:
            mark = "" if r["new_over_base"] >= 1 - TOLERANCE else "   SLOWER by more than 5%"
            print(f"{r['metric']:<{width}}{r['base']:>10.2f}{r['new']:>10.2f}{r['new_over_base']:>9.3f}x{mark}")
        for r in one_sided:
            print(f"{r['metric']:<{width}} only {r['side']} measures it: {r['best']:.2f}")
        busy = [r["others_busy_cores"] for r in runs if (r["others_busy_cores"] or 0) > BUSY_LIMIT]
        if busy:
            print(f"warning: {len(busy)} of {len(runs)} runs had other work keeping up to {max(busy):.1f} cores "
                  "busy; figures may be distorted")
        wall = time.perf_counter() - started
        print(f"total {wall / 60:.1f} min")

        params = args_dict(args) | {"cpu_isa": os.environ.get("PAGED_RUNTIME_CPU_ISA", "auto")}  # both sides' kernels
        report = {"parameters": params, "machine": machine_info(),
                  "base": {"spec": args.base, "commit": base.commit, "desc": base.desc,
                           "paged_runtime_file": imports.get("base")},
                  "new": {"spec": args.new or str(ROOT), "commit": new.commit, "desc": new.desc,
                          "paged_runtime_file": imports.get("new")},
                  "commands": [{"name": c.name, "script": f"benchmarks/{c.script}.py", "argv": c.argv}
                               for c in cmds],
                  "tolerance": TOLERANCE, "rows": rows, "one_sided": one_sided,
                  "all_within_tolerance": all(r["new_over_base"] >= 1 - TOLERANCE for r in rows),
                  "runs": runs, "wall_seconds": wall}
        print(write_results(args.out, report, draw if rows else None, rows, args.out.stem))
        return 0
    finally:
        for t in trees:
            t.remove()
        if args.keep:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
