"""Graceful shutdown of ``paged-runtime serve`` (issue 19, item 6), on a real server process.

Two servers, each sent SIGTERM with requests in flight. With a timeout that is only a hang guard
(``--shutdown-timeout 600``): /health and new requests turn 503 ``server_shutting_down`` while a
stream runs on and ends normally, and the process exits 0 as soon as it has (not 600 s later). With
``--shutdown-timeout 0.5``: a long stream and a long non-streaming request (1000 tokens with logprobs
take the tiny model seconds) are ended by the engine's shutdown: the stream with its content, an error
event and ``[DONE]``, the other with an OpenAI 503 body; the process exits 0. Waits are on events (the
first chunk, /metrics, /health); every timeout is a hang guard only.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from .conftest import free_socket
from .test_cli import run_cli

pytestmark = [pytest.mark.server]

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "logprobs": 5}
MEDIUM = {"model": "tiny", "prompt": "Hello", "max_tokens": 64, "ignore_eos": True}  # 64 steps: runs on after SIGTERM
SHORT = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
HANG_GUARD = 60.0


def start_server(model_dir, *flags: str):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = run_cli("serve", str(model_dir), "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
                   "--kv-cache-memory", "16MiB", "--served-model-name", "tiny", "--disable-log-stats", *flags)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def running_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


class Stream:
    """A streaming completion read line by line: ``first()`` returns once the first event has arrived."""

    def __init__(self, client: httpx.Client, url: str, body: dict) -> None:
        self._cm = client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True})
        self.response = self._cm.__enter__()
        self._lines = self.response.iter_lines()
        self.events: list[str] = []

    def first(self) -> dict:
        assert self.response.status_code == 200
        self.events.append(next(line for line in self._lines if line))
        return json.loads(self.events[0].removeprefix("data: "))

    def rest(self) -> list[str]:
        self.events.extend(line for line in self._lines if line)
        self._cm.__exit__(None, None, None)
        return self.events


def payloads(events: list[str]) -> list[dict]:
    assert events[-1] == "data: [DONE]", events[-3:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_sigterm_refuses_new_requests_and_lets_the_ones_in_flight_finish_then_exits_0(tiny_llama_dir):
    proc, url = start_server(tiny_llama_dir, "--shutdown-timeout", "600")
    try:
        with httpx.Client(timeout=HANG_GUARD) as client:
            stream = Stream(client, url, MEDIUM)
            stream.first()
            proc.send_signal(signal.SIGTERM)

            # no new work: /health says 503 (load balancers drain), and so does a new request
            wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, "/health to turn 503")
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.json()["error"]["code"] == "server_shutting_down"
            refused = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json() == {"error": {"message": "The server is shutting down; retry the request on "
                                                           "another replica.", "type": "server_error", "param": None,
                                                "code": "server_shutting_down"}}

            # the request in flight finishes normally
            chunks = payloads(stream.rest())
            assert all("error" not in p for p in chunks)
            assert [c["finish_reason"] for p in chunks for c in p["choices"]][-1] == "length"
            assert len(chunks) >= 2
        out, _ = proc.communicate(timeout=HANG_GUARD)  # not 600 s: it stops once nothing is in flight
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "still running" not in out


def test_sigterm_ends_what_cannot_finish_in_time_with_openai_errors_and_exits_0(tiny_llama_dir):
    proc, url = start_server(tiny_llama_dir, "--shutdown-timeout", "0.5")
    try:
        unary: dict = {}

        def post_unary() -> None:
            unary["response"] = httpx.post(f"{url}/v1/completions", json=LONG, timeout=HANG_GUARD)

        unary_thread = threading.Thread(target=post_unary)
        unary_thread.start()
        wait_for(lambda: running_requests(url) >= 1, "the non-streaming request to run")
        with httpx.Client(timeout=HANG_GUARD) as client:
            stream = Stream(client, url, LONG)
            assert stream.first()["choices"][0]["finish_reason"] is None
            proc.send_signal(signal.SIGTERM)
            # the stream: its content, then an error event, then [DONE]
            chunks = payloads(stream.rest())
        assert len(chunks) >= 2 and all("choices" in p for p in chunks[:-1])
        assert all(c["finish_reason"] is None for p in chunks[:-1] for c in p["choices"])
        assert chunks[-1] == {"error": {"message": "the engine was shut down", "type": "server_error",
                                        "param": None, "code": "engine_unavailable"}}
        # the concurrent non-streaming request: an OpenAI error body, not a plain-text 500
        unary_thread.join(HANG_GUARD)
        response = unary["response"]
        assert response.status_code == 503
        assert response.json() == {"error": {"message": "the engine was shut down", "type": "server_error",
                                             "param": None, "code": "engine_unavailable"}}
        out, _ = proc.communicate(timeout=HANG_GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "shutting down: 2 request(s) still running; ending them with an error" in out
