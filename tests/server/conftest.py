"""Server fixtures: a real uvicorn on 127.0.0.1 (a free port) in a thread of the test process, and helpers.

The server runs in-process so tests can compare against the offline ``LLM``
and look at the engine's block accounting; it is started by a fixture and
always stopped (server, then engine) when the fixture ends. Each server gets
its own Prometheus registry, so metric values belong to that server alone.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from tests.helpers.openai_spec import openai_components

TINY_NAME = "tiny-llama"


@dataclass
class Server:
    url: str
    engine: object  # AsyncEngine
    registry: object  # CollectorRegistry
    model: str

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics as {(name, sorted labels): value}, via prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        labels = {"model_name": self.model, **labels}
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Polls /metrics until no request runs or waits and no KV block is held; returns the last sample."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            key = lambda name: (name, (("model_name", self.model),))
            gauges = [metrics.get(key(n)) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                     "vllm:kv_cache_usage_perc")]
            if gauges == [0.0, 0.0, 0.0] and self.engine.num_unfinished_requests == 0:
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: running, waiting, kv = {gauges}")
            time.sleep(0.02)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def running_server(model_dir, name: str, *, api_key: str | None = None, max_waiting_requests: int | None = None,
                   app_options: dict | None = None, step_timeout: float | None = None, **engine_kwargs):
    """An AsyncEngine over ``model_dir`` behind uvicorn on 127.0.0.1; stopped on exit. ``app_options``: more
    ``build_app`` keywords (``chat_template``, ``chat_options``, ...); ``step_timeout``: the engine's watchdog."""
    from prometheus_client import CollectorRegistry

    from paged_runtime.config import EngineConfig
    from paged_runtime.engine.async_engine import AsyncEngine
    from paged_runtime.entrypoints.openai import build_app
    from paged_runtime.metrics import PrometheusStatLogger

    engine_kwargs.setdefault("dtype", "float32")
    engine_kwargs.setdefault("debug_checks", True)
    registry = CollectorRegistry()
    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), served_model_name=name, **engine_kwargs),
                                     max_waiting_requests=max_waiting_requests,
                                     stat_loggers=[PrometheusStatLogger(name, registry)], step_timeout=step_timeout)
    app = build_app(engine, [name], api_key=api_key, registry=registry, **(app_options or {}))
    try:
        with serving(app) as url:
            yield Server(url, engine, registry, name)
    finally:
        engine.shutdown()


@contextmanager
def serving(app):
    """``app`` behind uvicorn on 127.0.0.1 (a free port), in a thread; yields its URL; stopped on exit."""
    import uvicorn
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=5,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        host, port = sock.getsockname()
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir):
    with running_server(tiny_llama_dir, TINY_NAME, max_model_len=512, max_num_seqs=64,
                        kv_cache_memory=32 * 2**20) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """The offline API on the same weights: the reference for the server's greedy texts."""
    from tests.conftest import make_llm
    return make_llm(tiny_llama_dir, max_model_len=512, kv_cache_memory=32 * 2**20)


# ---- the OpenAI spec ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def openai_schema():
    """validate(schema_name, instance): checks a body against openai-subset.json, resolving its $refs."""
    import jsonschema
    components = openai_components()

    def validate(name: str, instance) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": components}
        jsonschema.Draft202012Validator(schema).validate(instance)

    return validate


# ---- SSE ---------------------------------------------------------------------------------------
def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, checking OpenAI's framing: ``data: <payload>`` blocks split by a blank line."""
    assert text.endswith("\n\n"), repr(text[-50:])
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, repr(block)
        events.append(block[len("data: "):])
    return events


def fail_on_step(engine, call: int, message: str) -> None:
    """Makes the AsyncEngine's ``call``-th engine step raise RuntimeError(message): a device failure."""
    real_step, calls = engine.engine.step, 0

    def step():
        nonlocal calls
        calls += 1
        if calls == call:
            raise RuntimeError(message)
        return real_step()

    engine.engine.step = step
