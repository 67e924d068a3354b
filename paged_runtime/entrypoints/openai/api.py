"""The OpenAI-compatible routes as one reusable FastAPI router, and an app factory around it.

``build_router(engine, ...)`` is what the standalone server, the KServe
adapter and the Ray Serve ingress all mount. It is self-contained: bodies
are parsed and validated inside the routes and every failure is turned into
an OpenAI error body by the router's own route class, so the host app needs
no exception handlers of ours.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models
(these three need ``Authorization: Bearer <api_key>`` when a key is set),
GET /health, GET /version, POST /tokenize, POST /detokenize, GET /metrics.

A client that disconnects aborts its request: streaming responses watch for
the disconnect while they send; non-streaming ones race the generation
against it.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from paged_runtime.engine.client import EngineClient
from paged_runtime.entrypoints.openai.drain import Drain, DrainMiddleware
from paged_runtime.entrypoints.openai.errors import OpenAIError, bad_request, from_exception, parse_json, unauthorized
from paged_runtime.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                       TokenizeRequest)
from paged_runtime.entrypoints.openai.serving import OpenAIServing, StreamingResult
from paged_runtime.entrypoints.openai.serving_chat import ChatServing
from paged_runtime.entrypoints.openai.serving_completion import CompletionServing

ModelT = TypeVar("ModelT", bound=BaseModel)
CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client never sees it


class OpenAIRoute(APIRoute):
    """Turns any exception escaping a route (auth included) into an OpenAI error response."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:
                return from_exception(e).response()

        return guarded


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that always closes its body and aborts its requests, however it ends.

    It watches for the client's disconnect while sending, whatever ASGI spec
    version the server speaks, so an abandoned stream frees its blocks at once.
    """

    def __init__(self, result: StreamingResult) -> None:
        super().__init__(result.body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.result = result

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.result.abort()
            await self.body_iterator.aclose()


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, or None if the client disconnected first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client left first: cancelling the generation aborts its requests
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)  # let the cancellation (and abort) finish
        return None
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _parse(request: Request, model: type[ModelT]) -> ModelT:
    data = parse_json(await request.body())
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    return model.model_validate(data)


def api_key_checker(api_key: str | None) -> Callable[[Request], None]:
    """A dependency that checks ``Authorization: Bearer <api_key>`` in constant time (no-op without a key)."""
    expected = api_key.encode() if api_key else None

    def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise unauthorized("Incorrect API key provided.")

    return check


def default_served_model_names(engine: EngineClient) -> list[str]:
    """The config's served_model_name, else the model path as given, else the embedded default's name."""
    from paged_runtime.models.default_model import DEFAULT_MODEL_NAME
    return [engine.config.served_model_name or engine.config.model or DEFAULT_MODEL_NAME]


def build_router(engine: EngineClient, served_model_names: Sequence[str] | None = None, *,
                 api_key: str | None = None, registry: CollectorRegistry | None = None,
                 model_root: str | None = None, include_metrics: bool = True) -> APIRouter:
    """All routes over ``engine``. ``registry`` is what /metrics shows (default: the global REGISTRY);
    hosts with a /metrics of their own (KServe) pass ``include_metrics=False`` and share the registry."""
    from paged_runtime import __version__
    served_model_names = list(served_model_names or default_served_model_names(engine))
    completions = CompletionServing(engine, served_model_names)
    chat = ChatServing(engine, served_model_names)
    created = int(time.time())
    root = model_root or engine.model_root
    router = APIRouter(route_class=OpenAIRoute)
    auth = [Depends(api_key_checker(api_key))]

    async def respond(request: Request, serving: CompletionServing | ChatServing, body: BaseModel) -> Response:
        result = await serving.create(body)  # type: ignore[arg-type]
        if isinstance(result, StreamingResult):
            return SSEResponse(result)
        return JSONResponse(result)

    @router.post("/v1/completions", dependencies=auth)
    async def create_completion(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        response = await _until_disconnect(request, respond(request, completions, body))
        return response or Response(status_code=CLIENT_CLOSED_REQUEST)

    @router.post("/v1/chat/completions", dependencies=auth)
    async def create_chat_completion(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        response = await _until_disconnect(request, respond(request, chat, body))
        return response or Response(status_code=CLIENT_CLOSED_REQUEST)

    @router.get("/v1/models", dependencies=auth)
    async def list_models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "paged-runtime",
             "root": root, "parent": None, "max_model_len": engine.max_model_len}
            for name in served_model_names]}

    @router.get("/health")
    async def health() -> Response:
        engine.check_health()
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return _tokenize(chat, await _parse(request, TokenizeRequest))

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return _detokenize(chat, await _parse(request, DetokenizeRequest))

    if include_metrics:
        source = registry if registry is not None else REGISTRY

        @router.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(source), media_type=CONTENT_TYPE_LATEST)

    return router


def _tokenize(serving: ChatServing, req: TokenizeRequest) -> dict:
    serving.resolve_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
    tokenizer = serving.engine.tokenizer
    if req.messages is not None:
        text, _ = serving.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs)
        token_ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        token_ids = tokenizer.encode(req.prompt, add_special_tokens=add_special)
    return {"count": len(token_ids), "max_model_len": serving.engine.max_model_len, "tokens": token_ids,
            "token_strs": tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None}


def _detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict:
    serving.resolve_model(req.model)
    vocab_size = serving.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range for vocabulary size {vocab_size}", param="tokens")
    return {"prompt": serving.engine.tokenizer.decode(req.tokens)}


def build_app(engine: EngineClient, served_model_names: Sequence[str] | None = None, *, api_key: str | None = None,
              registry: CollectorRegistry | None = None, model_root: str | None = None,
              include_metrics: bool = True, drain: Drain | None = None) -> FastAPI:
    """A FastAPI app serving ``build_router``'s routes; it does not own the engine (the caller shuts it down).
    ``drain``: while it drains, every request is a 503 ``server_shutting_down`` (see ``drain.py``)."""
    from paged_runtime import __version__
    app = FastAPI(title="paged-runtime OpenAI-compatible server", version=__version__)
    app.include_router(build_router(engine, served_model_names, api_key=api_key, registry=registry,
                                    model_root=model_root, include_metrics=include_metrics))

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return OpenAIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return OpenAIError(405, f"method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed").response()

    if drain is not None:
        app.add_middleware(DrainMiddleware, drain=drain)
    return app
