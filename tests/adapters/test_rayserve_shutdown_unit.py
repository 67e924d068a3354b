"""rayserve_adapter's shutdown path without a Ray cluster: the deployments' graceful shutdown timeout follows
``shutdown_timeout``; the replica's ``__del__`` (as Serve awaits it) drains, then fails what still runs with
an error event and [DONE]; the ingress ends a response whose model replica died with an OpenAI error,
never a cut stream or a plain 500."""
from __future__ import annotations

import asyncio
import inspect
import json

import httpx
import pytest

pytest.importorskip("ray.serve")

from rayserve_adapter import AppArgs, app  # noqa: E402
from rayserve_adapter.asgi import ForwardedRequest, ResponseStart  # noqa: E402
from rayserve_adapter.builder import SHUTDOWN_MARGIN_S  # noqa: E402
from rayserve_adapter.router import routing_key  # noqa: E402

JSON = ((b"content-type", b"application/json"),)
SSE = ((b"content-type", b"text/event-stream; charset=utf-8"),)
REPLICA_GONE = {"message": "the model replica stopped before the response was complete (RuntimeError)",
                "type": "server_error", "param": None, "code": "engine_unavailable"}


def test_graceful_shutdown_timeouts_follow_shutdown_timeout():
    assert AppArgs.model_validate({}).shutdown_timeout == 30.0  # a pod's default grace period
    with pytest.raises(ValueError, match="shutdown_timeout"):
        AppArgs.model_validate({"shutdown_timeout": -1})
    single = app({"shutdown_timeout": "12"})._bound_deployment
    assert single._deployment_config.graceful_shutdown_timeout_s == 12.0
    ingress = app({"num_replicas": 2, "shutdown_timeout": 12})._bound_deployment
    model = ingress.init_args[0]._bound_deployment
    assert model._deployment_config.graceful_shutdown_timeout_s == 12.0
    assert ingress._deployment_config.graceful_shutdown_timeout_s == 12.0 + SHUTDOWN_MARGIN_S


def forwarded(body: dict) -> ForwardedRequest:
    data = json.dumps(body).encode()
    return ForwardedRequest("POST", "/v1/completions", b"", JSON, data, routing_key("/v1/completions", data))


def test_serve_awaits_the_replicas_graceful_shutdown_as_its_destructor():
    from rayserve_adapter.deployment import PagedRuntimeBackend, PagedRuntimeServer, ServeEngineReplica
    assert inspect.iscoroutinefunction(ServeEngineReplica.__del__)  # Serve awaits it on the replica's loop
    assert issubclass(PagedRuntimeBackend.func_or_class, ServeEngineReplica)
    assert issubclass(PagedRuntimeServer.func_or_class, ServeEngineReplica)


def test_replica_drains_then_ends_a_stream_that_cannot_finish_with_an_error(tiny_llama_dir):
    from rayserve_adapter.deployment import EngineReplica
    replica = EngineReplica({"model": str(tiny_llama_dir), "served_model_name": "tiny", "dtype": "float32",
                                  "max_model_len": 512, "kv_cache_memory": 8 * 2**20, "max_num_seqs": 2,
                                  "shutdown_timeout": 0.2})
    long = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "logprobs": 5, "stream": True}

    async def scenario():
        stream = replica.forward(forwarded(long))
        start = await stream.__anext__()
        assert start.status == 200
        chunks = [await stream.__anext__()]
        shutdown = asyncio.create_task(replica.graceful_shutdown())  # ServeEngineReplica.__del__
        while not replica.drain.draining:
            await asyncio.sleep(0)
        refused = [p async for p in replica.forward(forwarded({"prompt": "Hi", "max_tokens": 2}))]
        assert refused[0].status == 503
        assert json.loads(b"".join(refused[1:]))["error"]["code"] == "server_shutting_down"
        chunks += [chunk async for chunk in stream]
        await asyncio.wait_for(shutdown, 60)
        return chunks

    try:
        events = b"".join(asyncio.run(scenario())).decode().split("\n\n")
    finally:
        replica.shutdown()
    events = [e for e in events if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
    assert len(events) >= 3 and all('"choices"' in e for e in events[:-2])
    assert not replica.engine.is_healthy


class DyingStream:
    """A DeploymentResponseGenerator whose replica dies after ``parts``."""

    def __init__(self, parts: list) -> None:
        self.parts = list(parts)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.parts:
            raise RuntimeError("the actor died unexpectedly")
        return self.parts.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, stream: DyingStream) -> None:
        self.stream = stream
        self.forward = self

    def options(self, **kwargs):
        return self

    def remote(self, request):
        return self.stream


def ingress_post(stream: DyingStream, body: dict) -> httpx.Response:
    from rayserve_adapter.deployment import OpenAIIngress
    asgi = OpenAIIngress(FakeHandle(stream)).__serve_build_asgi_app__()

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://test") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(post())


def test_ingress_ends_a_stream_whose_replica_died_with_an_error_event_and_done():
    first = b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
    stream = DyingStream([ResponseStart(200, SSE), first])
    response = ingress_post(stream, {"prompt": "Hi", "stream": True})
    assert response.status_code == 200
    assert response.text == (first.decode() + "data: " + json.dumps({"error": REPLICA_GONE}, separators=(",", ":"))
                             + "\n\ndata: [DONE]\n\n")


@pytest.mark.parametrize("parts", [[], [ResponseStart(200, JSON)]], ids=["before-start", "mid-body"])
def test_ingress_answers_503_with_an_openai_body_when_the_replica_died(parts):
    stream = DyingStream(parts)
    response = ingress_post(stream, {"prompt": "Hi"})
    assert response.status_code == 503 and response.json() == {"error": REPLICA_GONE}
    assert stream.cancelled


def test_ingress_refuses_a_body_over_the_limit_without_forwarding_it():
    from rayserve_adapter.deployment import OpenAIIngress

    class NeverCalled(FakeHandle):
        def remote(self, request):
            raise AssertionError("an oversized body must not reach a model replica")

    asgi = OpenAIIngress(NeverCalled(DyingStream([])), max_request_body_bytes=64).__serve_build_asgi_app__()

    async def post(content, headers):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://test") as client:
            return await client.post("/v1/completions", content=content, headers=headers)

    async def chunked():  # no Content-Length: the limit holds while the body streams in
        for _ in range(4):
            yield b"x" * 32

    for content in (b"x" * 65, chunked()):
        response = asyncio.run(post(content, {"content-type": "application/json"}))
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"


def test_app_args_carry_the_http_edge_options_to_the_replica_app():
    from rayserve_adapter.args import parse_args
    args = parse_args({"max_request_body_bytes": 1024, "max_prompts_per_request": 2,
                       "allowed_origins": ["https://app.example.com"], "metrics_require_api_key": True})
    assert (args.max_request_body_bytes, args.max_prompts_per_request) == (1024, 2)
    assert args.allowed_origins == ["https://app.example.com"] and args.metrics_require_api_key
