"""The soak (tests/helpers/soak.py; benchmarks/soak.py runs it too) for 60 seconds with 8 clients: every one of
its checks must pass.

It starts its own server subprocess on the session's tiny random Llama, so it
takes about 90 seconds. Before issue 19's fixes it failed on: wrong content type
(200, not 415), lone surrogates and deep nesting (500s), oversized bodies (no 413),
and the bounds category (top_k above int64 killed the engine, then everything was 503).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

def test_soak_60_seconds_every_check_passes(tiny_llama_dir, tmp_path):
    output = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "soak.py"), "--seconds", "60",
                          "--clients", "8", "--model", str(tiny_llama_dir), "--output", str(output)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert output.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(output.read_text())
    failed = [c for c in report["checks"] if not c["passed"]]
    message = "\n".join(f"{c['name']}: {c['detail']}" for c in failed)
    assert not failed, f"soak checks failed:\n{message}\n\n{run.stdout[-4000:]}"
    assert run.returncode == 0 and report["passed"]
    assert report["requests"] > 0 and all(row["sent"] > 0 for row in report["categories"].values())
