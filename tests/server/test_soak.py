"""The soak (benchmarks/soak.py) for 60 seconds with 8 clients: every one of its checks must pass.

It starts its own server subprocess on the session's tiny random Llama, so it
takes about 90 seconds. Some checks expect what issue 19 asks for and today's
main does not yet do; until those fixes are merged this test fails on them, and
its message says which item each failing check waits for (PENDING_ON).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The checks that fail on the main this test was written against (the commit of issue 19's contracts), and the
# issue-19 item whose fix makes them pass.
PENDING_ON = {
    "status:wrong_content_type": "item 9: POST routes need application/json (415)",
    "status:lone_surrogate": "item 9: a lone surrogate is a 400 (today a plain-text 500)",
    "status:deep_nesting": "item 9: deep nesting is a 400 (today a 500)",
    "status:oversized_body": "item 4: a request body limit (413)",
    "status:bounds": "item 1: bounds at the edge (top_k > int64 and seed + i overflow kill today's engine)",
    "no_5xx": "items 1 and 9 (500s from deep nesting / surrogates, 503s once a bounds request killed the engine)",
    "health": "item 1 (a bounds request kills the engine: /health 503)",
    "schema": "items 1 and 9 (error events from the dying engine; the surrogate 500 is plain text, not JSON)",
    **{f"status:{name}": "item 1 (503 once a bounds request killed the engine)"
       for name in ("completion", "completion_stream", "chat", "chat_stream", "parallel", "disconnect", "abort")},
}


def test_soak_60_seconds_every_check_passes(tiny_llama_dir, tmp_path):
    output = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--seconds", "60", "--clients", "8",
                          "--model", str(tiny_llama_dir), "--output", str(output)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert output.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(output.read_text())
    failed = [c for c in report["checks"] if not c["passed"]]
    message = "\n".join(f"{c['name']}: {c['detail']}" + (f"  [pending: {PENDING_ON[c['name']]}]"
                                                         if c["name"] in PENDING_ON else "") for c in failed)
    assert not failed, f"soak checks failed:\n{message}\n\n{run.stdout[-4000:]}"
    assert run.returncode == 0 and report["passed"]
    assert report["requests"] > 0 and all(row["sent"] > 0 for row in report["categories"].values())
