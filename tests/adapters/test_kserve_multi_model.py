"""``python -m kserve_adapter --model A --model B``: two KServe models in one process, each on the v1 / v2 routes
under its own name and both behind the OpenAI routes, which pick one by ``model``. Greedy texts come from the
right model (two tiny Llamas of different weights; the offline ``LLM`` of each is the reference)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.adapters.test_kserve_server import START_TIMEOUT, KServeProcess, free_port
from tests.conftest import make_llm

pytestmark = [pytest.mark.kserve]

PROMPT = "The harbour master wrote"


@pytest.fixture(scope="module")
def kserve_two(two_models_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("kserve-two") / "server.log"
    port = free_port()
    cmd = [sys.executable, "-m", "kserve_adapter", "--model", str(two_models_dir / "alpha"),
           "--model", str(two_models_dir / "beta"), "--host", "127.0.0.1", "--http_port", str(port),
           "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB", "--disable-log-stats"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                cwd=Path(__file__).parents[2])
    server = KServeProcess(proc, f"http://127.0.0.1:{port}", port, log, log)
    try:
        for name in ("alpha", "beta"):
            server.wait_until(f"/v2/models/{name}/ready", 200, START_TIMEOUT)
        server.wait_until("/openai/v1/models", 200, START_TIMEOUT)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def greedy_text(model_dir) -> str:
    from paged_runtime import SamplingParams
    llm = make_llm(model_dir, max_model_len=128, kv_cache_memory=8 * 2**20)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].text


def test_each_model_answers_under_its_own_name_on_every_protocol(kserve_two, two_models_dir):
    expected = {name: greedy_text(two_models_dir / name) for name in ("alpha", "beta")}
    assert expected["alpha"] != expected["beta"]
    assert kserve_two.get("/v1/models").json() == {"models": ["alpha", "beta"]}
    listed = kserve_two.get("/openai/v1/models").json()["data"]
    assert [(m["id"], m["status"]) for m in listed] == [("alpha", {"value": "loaded"}), ("beta", {"value": "loaded"})]
    for name, text in expected.items():
        body = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = kserve_two.post("/openai/v1/completions", body)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == text
        v1 = {"instances": [{"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}]}
        predictions = kserve_two.post(f"/v1/models/{name}:predict", v1).json()["predictions"]
        assert [p["text"] for p in predictions] == [text], name
    response = kserve_two.post("/openai/v1/completions", {"model": "gamma", "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert str(two_models_dir) not in response.text
    assert httpx.get(f"{kserve_two.url}/v2/models/gamma/ready", timeout=10).status_code == 404
