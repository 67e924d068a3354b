"""``python -m kserve_adapter`` as KServe runs it: a real ModelServer subprocess on 127.0.0.1 over the tiny model.

One server for the module; the tests run in file order and share it:
loading (503) -> ready (200) -> v1 / v2 / OpenAI traffic -> bad inputs ->
SIGTERM. The loading window is held open by the adapter's test-only hook
(``KSERVE_ADAPTER_LOAD_GATE``: the engine is not built until a file exists),
so the 503s are observed without racing the load. Greedy texts are compared
with the offline ``LLM`` on the same weights.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.kserve]

NAME = "tiny-kserve"
API_KEY = "kserve-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]
MAX_MODEL_LEN = 1024
START_TIMEOUT = 180.0  # a loaded 2-core CI machine imports torch + kserve slowly
MAX_BODY_BYTES, MAX_PROMPTS = 65536, 8
TOO_LARGE = f"The request body is larger than this server's limit of {MAX_BODY_BYTES} bytes."


@dataclass
class KServeProcess:
    proc: subprocess.Popen
    url: str
    port: int
    gate: Path
    log: Path

    def get(self, path: str, auth: bool = True, **kwargs) -> httpx.Response:
        """GET ``path``, with the API key unless ``auth`` is False."""
        return httpx.get(self.url + path, headers=AUTH if auth else {}, timeout=30, **kwargs)

    def post(self, path: str, body, headers: dict | None = None, auth: bool = True, **kwargs) -> httpx.Response:
        """POST ``body`` as JSON, with the API key unless ``auth`` is False."""
        content = json.dumps(body) if isinstance(body, (dict, list)) else body  # bytes, str or chunks
        headers = {**JSON, **(AUTH if auth else {}), **(headers or {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kwargs)

    def wait_until(self, path: str, status: int, timeout: float = START_TIMEOUT) -> httpx.Response:
        """Polls GET ``path`` until it answers ``status``; fails if the server exits or the deadline passes."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.log_text()}"
            try:
                response = self.get(path)
                if response.status_code == status:
                    return response
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"GET {path} never answered {status}:\n{self.log_text()[-3000:]}"
            time.sleep(0.1)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = self.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float | None:
        return self.metrics().get((name, tuple(sorted({"model_name": NAME, **labels}.items()))))

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while (self.metric("vllm:num_requests_running"), self.metric("vllm:num_requests_waiting")) != (0.0, 0.0):
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def kserve_server(tiny_llama_dir, tmp_path_factory):
    """The adapter, started with its engine held back by the load gate; stopped (SIGTERM, then kill) at the end."""
    folder = tmp_path_factory.mktemp("kserve")
    gate, log = folder / "load-gate", folder / "server.log"
    port = free_port()
    cmd = [sys.executable, "-m", "kserve_adapter", "--model_name", NAME, "--model", str(tiny_llama_dir),
           "--host", "127.0.0.1", "--http_port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
           "--kv-cache-memory", "16MiB", "--max-num-seqs", "16", "--api-key", API_KEY, "--log-stats-interval", "1",
           "--shutdown-timeout", "1", "--max-request-body-bytes", str(MAX_BODY_BYTES),
           "--max-prompts-per-request", str(MAX_PROMPTS)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KSERVE_ADAPTER_LOAD_GATE": str(gate)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[2])
    server = KServeProcess(proc, f"http://127.0.0.1:{port}", port, gate, log)
    try:
        server.wait_until("/", 200)  # live: KServe's routes answer while the engine waits for the gate
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def kserve_ready(kserve_server):
    """The same server once its engine serves (opens the load gate if no test did yet)."""
    kserve_server.gate.touch()
    kserve_server.wait_until(f"/v2/models/{NAME}/ready", 200)
    return kserve_server


@pytest.fixture(scope="module")
def kserve_reference(tiny_llama_dir):
    """The offline API on the same weights, the reference for greedy texts."""
    from paged_runtime import LLM
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 * 2**20)


def greedy(llm, prompts, max_tokens: int):
    from paged_runtime import SamplingParams
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0),
                                              use_tqdm=False)]


def usage(llm, prompt, output) -> dict:
    num_prompt = len(llm.get_tokenizer().encode(prompt)) if isinstance(prompt, str) else len(prompt)
    return {"prompt_tokens": num_prompt, "completion_tokens": len(output.token_ids),
            "total_tokens": num_prompt + len(output.token_ids)}


def decode_bytes_tensor(raw: bytes) -> list[str]:
    """KServe's binary BYTES tensor: each element a little-endian uint32 length, then its bytes."""
    items, offset = [], 0
    while offset < len(raw):
        length = int.from_bytes(raw[offset:offset + 4], "little")
        items.append(raw[offset + 4:offset + 4 + length].decode("utf-8"))
        offset += 4 + length
    return items


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (IPv4 and IPv6), from /proc/net."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                addresses.add(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words))
    return addresses


# ---- loading -----------------------------------------------------------------------------------
def test_not_ready_while_loading_then_ready(kserve_server):
    assert not kserve_server.gate.exists(), "run this module in file order: the engine is already loading"
    not_ready = {"error": f"Model with name {NAME} is not ready."}
    for path in (f"/v1/models/{NAME}", f"/v2/models/{NAME}/ready"):
        response = kserve_server.get(path)
        assert (response.status_code, response.json()) == (503, not_ready), path
    response = kserve_server.post(f"/v1/models/{NAME}:predict", {"instances": ["hi"]})
    assert (response.status_code, response.json()) == (503, not_ready)
    for path in ("/openai/v1/completions", "/v1/completions", "/v1/chat/completions"):
        response = kserve_server.post(path, {"prompt": "hi"}, headers=AUTH)
        assert response.status_code == 503 and response.headers["retry-after"] == "5", path
        assert response.json() == {"error": {"message": f"The model `{NAME}` is loading; retry later.",
                                             "type": "server_error", "param": None, "code": "model_not_ready"}}
    assert kserve_server.get("/").json() == {"status": "alive"}
    assert kserve_server.get(f"/v2/models/{NAME}").status_code == 200  # metadata does not need the engine

    kserve_server.gate.touch()
    response = kserve_server.wait_until(f"/v2/models/{NAME}/ready", 200)
    assert response.json() == {"name": NAME, "ready": True}
    assert kserve_server.get(f"/v1/models/{NAME}").json() == {"name": NAME, "ready": True}
    assert kserve_server.get("/v1/models").json() == {"models": [NAME]}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc/net")
def test_binds_loopback_only(kserve_ready):
    assert listening_addresses(kserve_ready.port) == {"127.0.0.1"}


# ---- v1 / v2 -----------------------------------------------------------------------------------
def test_v1_predict_matches_offline_greedy(kserve_ready, kserve_reference):
    token_ids = [5, 6, 7, 8]
    body = {"instances": [{"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0},
                          {"prompt": PROMPTS[1], "max_tokens": 7, "temperature": 0, "top_k": 5, "seed": 3},
                          {"prompt": token_ids, "max_tokens": 5, "temperature": 0}]}
    response = kserve_ready.post(f"/v1/models/{NAME}:predict", body)
    assert response.status_code == 200, response.text
    expected = (greedy(kserve_reference, PROMPTS[:1], 12) + greedy(kserve_reference, PROMPTS[1:], 7)
                + greedy(kserve_reference, [{"prompt_token_ids": token_ids}], 5))
    prompts = [PROMPTS[0], PROMPTS[1], token_ids]
    assert response.json() == {"predictions": [
        {"text": e.text, "finish_reason": e.finish_reason, "usage": usage(kserve_reference, p, e)}
        for p, e in zip(prompts, expected)]}


def test_v1_predict_plain_strings_default_to_16_tokens(kserve_ready):
    body = {"instances": [PROMPTS[0], {"prompt": PROMPTS[1], "ignore_eos": True}]}
    predictions = kserve_ready.post(f"/v1/models/{NAME}:predict", body).json()["predictions"]
    assert predictions[1]["usage"]["completion_tokens"] == 16 and predictions[1]["finish_reason"] == "length"
    assert predictions[0]["usage"]["completion_tokens"] <= 16


def test_v2_metadata_lists_the_tensors(kserve_ready):
    assert kserve_ready.get(f"/v2/models/{NAME}").json() == {
        "name": NAME, "versions": None, "platform": "",
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]},
                    {"name": "finish_reason", "datatype": "BYTES", "shape": [-1]}]}


def test_v2_infer_matches_offline_greedy(kserve_ready, kserve_reference):
    body = {"id": "req-42", "parameters": {"max_tokens": 9, "temperature": 0},
            "inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": PROMPTS}]}
    response = kserve_ready.post(f"/v2/models/{NAME}/infer", body)
    assert response.status_code == 200, response.text
    expected = greedy(kserve_reference, PROMPTS, 9)
    num_prompt = sum(usage(kserve_reference, p, e)["prompt_tokens"] for p, e in zip(PROMPTS, expected))
    assert response.json() == {
        "id": "req-42", "model_name": NAME, "model_version": None,
        "parameters": {"prompt_tokens": num_prompt, "completion_tokens": sum(len(e.token_ids) for e in expected)},
        "outputs": [{"name": "text_output", "shape": [2], "datatype": "BYTES", "parameters": None,
                     "data": [e.text for e in expected]},
                    {"name": "finish_reason", "shape": [2], "datatype": "BYTES", "parameters": None,
                     "data": [e.finish_reason for e in expected]}]}
    only_text = {**body, "outputs": [{"name": "text_output"}]}
    outputs = kserve_ready.post(f"/v2/models/{NAME}/infer", only_text).json()["outputs"]
    assert [(o["name"], o["data"]) for o in outputs] == [("text_output", [e.text for e in expected])]
    # KServe's binary tensor extension passes through: JSON header, then length-prefixed UTF-8 strings.
    binary = {**body, "parameters": {**body["parameters"], "binary_data_output": True}}
    response = kserve_ready.post(f"/v2/models/{NAME}/infer", binary)
    json_length = int(response.headers["inference-header-content-length"])
    header, raw = json.loads(response.content[:json_length]), response.content[json_length:]
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert [o["name"] for o in header["outputs"]] == ["text_output", "finish_reason"] and sum(sizes) == len(raw)
    assert decode_bytes_tensor(raw[:sizes[0]]) == [e.text for e in expected]
    assert decode_bytes_tensor(raw[sizes[0]:]) == [e.finish_reason for e in expected]


# ---- OpenAI routes -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kserve_openai(kserve_ready):
    return openai.OpenAI(base_url=f"{kserve_ready.url}/openai/v1", api_key=API_KEY, max_retries=0)


def test_openai_models_and_auth(kserve_ready, kserve_openai):
    assert [m.id for m in kserve_openai.models.list().data] == [NAME]
    response = kserve_ready.post("/openai/v1/completions", {"prompt": "hi"}, auth=False)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert kserve_ready.get("/openai/health", auth=False).status_code == 200


def test_kserve_routes_need_the_key_and_the_probes_stay_open(kserve_ready):
    """--api-key guards KServe's v1/v2 inference and metadata routes as it guards the OpenAI ones (a 401 in
    KServe's error shape); the probes Kubernetes runs, and /metrics, stay open."""
    v1 = {"instances": [{"prompt": "hi", "max_tokens": 1}]}
    v2 = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    for method, path, body in [("POST", f"/v1/models/{NAME}:predict", v1), ("POST", f"/v2/models/{NAME}/infer", v2),
                               ("GET", f"/v2/models/{NAME}", None), ("GET", "/v1/models", None),
                               ("GET", "/v2", None), ("GET", "/v2/models", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.request(method, kserve_ready.url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer" and "API key" in response.json()["error"]
    assert kserve_ready.post(f"/v1/models/{NAME}:predict", v1).status_code == 200
    assert kserve_ready.post(f"/v2/models/{NAME}/infer", v2).status_code == 200
    for path in ("/", "/v2/health/live", "/v2/health/ready", f"/v1/models/{NAME}", f"/v2/models/{NAME}/ready",
                 "/metrics", "/openai/health"):
        assert kserve_ready.get(path, auth=False).status_code == 200, path


def test_openai_completions_stream_and_not(kserve_ready, kserve_openai, kserve_reference):
    [expected] = greedy(kserve_reference, PROMPTS[:1], 14)
    whole = kserve_openai.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=14, temperature=0)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected.text, expected.finish_reason)
    assert whole.usage.completion_tokens == len(expected.token_ids)
    chunks = list(kserve_openai.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=14, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    # The same router answers at the root path, where OpenAI clients look without KServe's prefix.
    root = kserve_ready.post("/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 14,
                                                 "temperature": 0}, headers=AUTH)
    assert root.status_code == 200 and root.json()["choices"][0]["text"] == expected.text


def test_openai_chat_stream_and_not(kserve_ready, kserve_openai):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    whole = kserve_openai.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    stream = list(kserve_openai.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content and streamed
    assert stream[-1].usage.completion_tokens == whole.usage.completion_tokens
    root = kserve_ready.post("/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0},
                             headers=AUTH)
    assert root.json()["choices"][0]["message"]["content"] == whole.choices[0].message.content


def test_openai_stream_disconnect_aborts(kserve_ready):
    """A client that leaves mid-stream aborts its request: the abort counter moves and nothing keeps running."""
    before = kserve_ready.metric("vllm:request_success_total", finished_reason="abort") or 0.0
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True, "stream": True}

    async def leave_after_two_chunks() -> int:
        num_chunks = 0
        async with httpx.AsyncClient(base_url=kserve_ready.url, timeout=60) as client:
            async with client.stream("POST", "/openai/v1/completions", json=body, headers=AUTH) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        num_chunks += 1
                    if num_chunks == 2:
                        break  # closes the connection
        return num_chunks

    assert asyncio.run(leave_after_two_chunks()) == 2
    kserve_ready.wait_idle()
    assert kserve_ready.metric("vllm:request_success_total", finished_reason="abort") == before + 1


# ---- metrics -----------------------------------------------------------------------------------
def test_metrics_show_engine_and_kserve_series(kserve_ready):
    kserve_ready.wait_idle()
    metrics = kserve_ready.metrics()
    engine = lambda name: metrics.get((name, (("model_name", NAME),)))
    assert engine("vllm:num_requests_running") == 0.0
    assert engine("vllm:kv_cache_usage_perc") == 0.0
    assert engine("vllm:generation_tokens_total") > 0
    assert engine("request_predict_seconds_count") >= 3  # KServe's own histogram, beside the engine's


# ---- bad inputs: 4xx with a message, never a 500; the model stays healthy ------------------------
def v2_body(**tensor) -> dict:
    return {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"], **tensor}]}


KSERVE_BAD = [
    ("v1-not-json", f"/v1/models/{NAME}:predict", b"{nope", 400,
     "Unrecognized request format: unexpected character, expected a string key: line 1 column 2 (char 1)"),
    ("v1-list-body", f"/v1/models/{NAME}:predict", [1, 2], 400,
     'the request body must be a JSON object {"instances": [...]}'),
    ("v1-instances-not-list", f"/v1/models/{NAME}:predict", {"instances": 3}, 400, 'Expected "instances" to be a list'),
    ("v1-no-instances", f"/v1/models/{NAME}:predict", {"instances": []}, 400, "instances must be a non-empty list"),
    ("v1-number-instance", f"/v1/models/{NAME}:predict", {"instances": ["ok", 5]}, 400,
     "instances[1] must be a prompt string or an object with a 'prompt'"),
    ("v1-missing-prompt", f"/v1/models/{NAME}:predict", {"instances": [{"max_tokens": 3}]}, 400,
     "instances[0]: Missing required parameter: 'prompt'."),
    ("v1-bad-temperature", f"/v1/models/{NAME}:predict", {"instances": ["ok", {"prompt": "a", "temperature": -1}]},
     400, "instances[1]: temperature must be non-negative, got -1.0"),
    ("v1-unknown-field", f"/v1/models/{NAME}:predict", {"instances": [{"prompt": "a", "max_token": 3}]}, 400,
     "instances[0]: Invalid value for 'max_token': Extra inputs are not permitted"),
    ("v1-stream", f"/v1/models/{NAME}:predict", {"instances": [{"prompt": "a", "stream": True}]}, 400,
     "instances[0]: stream is not supported on the KServe inference routes; use /openai/v1/completions for that"),
    ("v1-too-long", f"/v1/models/{NAME}:predict", {"instances": [{"prompt": "a", "max_tokens": 5000}]}, 400,
     f"instances[0]: This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 5001 "
     "tokens (1 in the prompt, 5000 in the completion). Please reduce the length of the prompt or completion."),
    ("v1-token-out-of-vocab", f"/v1/models/{NAME}:predict", {"instances": [{"prompt": [1, 999999]}]}, 400,
     "instances[0]: prompt token id 999999 is out of range for vocabulary size 49152"),
    ("v1-too-many-instances", f"/v1/models/{NAME}:predict", {"instances": ["a"] * (MAX_PROMPTS + 1)}, 400,
     f"instances holds {MAX_PROMPTS + 1} prompts; this server takes at most {MAX_PROMPTS} per request"),
    ("v1-body-too-large", f"/v1/models/{NAME}:predict", {"instances": ["x" * MAX_BODY_BYTES]}, 413, TOO_LARGE),
    ("v1-unknown-model", "/v1/models/nope:predict", {"instances": ["a"]}, 404, "Model with name nope does not exist."),
    ("v1-explain", f"/v1/models/{NAME}:explain", {"instances": ["a"]}, 400,
     f"model {NAME} has no explainer; use :predict, /infer or the OpenAI routes"),
    ("v2-no-inputs", f"/v2/models/{NAME}/infer", {"inputs": []}, 400,
     "expected exactly one input, 'text_input' (BYTES, shape [batch]); got []"),
    ("v2-wrong-input", f"/v2/models/{NAME}/infer", v2_body(name="x"), 400,
     "expected exactly one input, 'text_input' (BYTES, shape [batch]); got ['x']"),
    ("v2-wrong-datatype", f"/v2/models/{NAME}/infer", v2_body(datatype="INT32", data=[1]), 400,
     "text_input must have datatype BYTES, got INT32"),
    ("v2-wrong-shape", f"/v2/models/{NAME}/infer", v2_body(shape=[2]), 400,
     "text_input must have shape [batch] (or [batch, 1]) matching its 1 elements; got shape [2]"),
    ("v2-not-a-string", f"/v2/models/{NAME}/infer", v2_body(data=[7]), 400, "text_input[0] must be a string, got int"),
    ("v2-bad-parameter", f"/v2/models/{NAME}/infer", {**v2_body(), "parameters": {"top_p": 0}}, 400,
     "parameters: top_p must be in (0, 1], got 0.0"),
    ("v2-prompt-parameter", f"/v2/models/{NAME}/infer", {**v2_body(), "parameters": {"prompt": "x"}}, 400,
     "parameters.prompt is not allowed: the prompts are the text_input tensor"),
    ("v2-too-long", f"/v2/models/{NAME}/infer", {**v2_body(), "parameters": {"max_tokens": 5000}}, 400,
     f"text_input[0]: This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 5001 "
     "tokens (1 in the prompt, 5000 in the completion). Please reduce the length of the prompt or completion."),
    ("v2-unknown-output", f"/v2/models/{NAME}/infer", {**v2_body(), "outputs": [{"name": "logits"}]}, 400,
     "unknown output 'logits'; this model has ['finish_reason', 'text_output']"),
    ("v2-unknown-model", "/v2/models/nope/infer", v2_body(), 404, "Model with name nope does not exist."),
    ("v2-too-many-prompts", f"/v2/models/{NAME}/infer",
     v2_body(shape=[MAX_PROMPTS + 1], data=["a"] * (MAX_PROMPTS + 1)), 400, f"text_input holds {MAX_PROMPTS + 1} prompts; this server takes at most {MAX_PROMPTS} per request"),
    ("v2-body-too-large", f"/v2/models/{NAME}/infer", v2_body(data=["x" * MAX_BODY_BYTES]), 413, TOO_LARGE),
]


@pytest.mark.parametrize("path,body,status,message", [case[1:] for case in KSERVE_BAD],
                         ids=[case[0] for case in KSERVE_BAD])
def test_kserve_routes_refuse_bad_input(kserve_ready, path, body, status, message):
    response = kserve_ready.post(path, body)
    assert (response.status_code, response.json()) == (status, {"error": message})


def test_chunked_bodies_over_the_limit_are_413_kserve_and_openai_style(kserve_ready):
    """Without a Content-Length the body is counted as it is read; the OpenAI routes keep their own 413."""
    big = json.dumps({"instances": ["x" * MAX_BODY_BYTES]}).encode()
    response = kserve_ready.post(f"/v1/models/{NAME}:predict", iter([big[:1000], big[1000:]]))
    assert (response.status_code, response.json()) == (413, {"error": TOO_LARGE})
    big = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()
    for content in (big, iter([big[:1000], big[1000:]])):
        response = kserve_ready.post("/openai/v1/completions", content, headers=AUTH)
        assert (response.status_code, response.json()["error"]["code"]) == (413, "request_too_large")


@pytest.mark.parametrize("body", [b"{nope", {"inputs": 1}, {"no_inputs": []},
                                  {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES"}]}],
                         ids=["not-json", "inputs-not-list", "no-inputs-field", "tensor-without-data"])
def test_v2_malformed_body_is_422(kserve_ready, body):
    """Bodies that are not an inference request at all are refused by KServe's own request model."""
    response = kserve_ready.post(f"/v2/models/{NAME}/infer", body)
    assert response.status_code == 422 and response.json()["detail"], response.text


OPENAI_BAD = [
    ("not-json", "/openai/v1/completions", b"{nope", 400, None, "invalid_json"),
    ("bad-temperature", "/openai/v1/completions", {"prompt": "a", "temperature": 9}, 400, "temperature",
     "invalid_value"),
    ("unknown-model", "/openai/v1/completions", {"prompt": "a", "model": "nope"}, 404, "model", "model_not_found"),
    ("root-too-long", "/v1/completions", {"prompt": "a", "max_tokens": 5000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("chat-no-messages", "/openai/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("root-chat-bad-role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("tokenize-neither", "/openai/tokenize", {}, 400, "prompt", None),
    ("detokenize-out-of-vocab", "/openai/detokenize", {"tokens": [-1]}, 400, "tokens", None),
]


@pytest.mark.parametrize("path,body,status,param,code", [case[1:] for case in OPENAI_BAD],
                         ids=[case[0] for case in OPENAI_BAD])
def test_openai_routes_refuse_bad_input(kserve_ready, path, body, status, param, code):
    response = kserve_ready.post(path, body, headers=AUTH)
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["param"], error["code"]) == (
        status, "invalid_request_error", param, code)
    assert error["message"]


def test_still_healthy_after_bad_inputs(kserve_ready):
    assert kserve_ready.get(f"/v2/models/{NAME}/ready").json() == {"name": NAME, "ready": True}
    response = kserve_ready.post(f"/v1/models/{NAME}:predict", {"instances": [{"prompt": "ok", "max_tokens": 3,
                                                                                "ignore_eos": True}]})
    assert response.status_code == 200
    assert response.json()["predictions"][0]["usage"]["completion_tokens"] == 3
    assert "500 Internal Server Error" not in kserve_ready.log_text()  # uvicorn's access log, all tests so far


# ---- shutdown ----------------------------------------------------------------------------------
def test_sigterm_drains_ends_the_rest_with_errors_and_stops_cleanly(kserve_ready):
    """SIGTERM with a long OpenAI stream and a long v1 predict in flight (--shutdown-timeout 1; neither can
    finish in time): new requests and the health routes are 503, the stream ends with an error event and
    [DONE], the predict with a 503 body, and the process exits 0."""
    predict = {}

    def post_predict() -> None:
        predict["response"] = kserve_ready.post(f"/v1/models/{NAME}:predict", {"instances": [
            {"prompt": "ok", "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True}]})

    thread = threading.Thread(target=post_predict)
    thread.start()
    deadline = time.monotonic() + 60
    while not kserve_ready.metric("vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the predict request never ran"
        time.sleep(0.05)
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True, "logprobs": 5,
            "stream": True}
    with httpx.stream("POST", kserve_ready.url + "/openai/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        lines = (line for line in response.iter_lines() if line)
        events = [next(lines)]
        kserve_ready.proc.send_signal(signal.SIGTERM)
        refused = kserve_ready.wait_until("/", 503, timeout=60)
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert kserve_ready.get(f"/v2/models/{NAME}/ready").status_code == 503
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "engine_unavailable" and error["error"]["type"] == "server_error"
    assert all('"choices"' in event for event in events[:-2])
    thread.join(60)
    assert predict["response"].status_code == 503
    assert predict["response"].json() == {"error": "the engine was shut down"}
    assert kserve_ready.proc.wait(60) == 0, kserve_ready.log_text()[-3000:]
    log = kserve_ready.log_text()
    assert f"engine of {NAME} shut down" in log
    assert "500 Internal Server Error" not in log
    with pytest.raises(httpx.ConnectError):
        kserve_ready.get("/")


def test_a_model_that_fails_to_build_exits_1(tmp_path):
    """The HTTP server is up before the engine builds; a model that cannot load must end the process, not
    leave a pod that answers 503 for ever."""
    (tmp_path / "README").write_text("not a model")
    port = free_port()
    cmd = [sys.executable, "-m", "kserve_adapter", "--model_name", "broken", "--model", str(tmp_path),
           "--host", "127.0.0.1", "--http_port", str(port)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=Path(__file__).parents[2])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"ValueError: {tmp_path} has no config.json" in proc.stderr
