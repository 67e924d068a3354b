"""The OpenAI-compatible routes as one reusable FastAPI router, and an app factory around it.

``build_router(engine, ...)`` is what the standalone server, the KServe
adapter and the Ray Serve ingress all mount. It is self-contained: bodies
are parsed and validated inside the routes and every failure is turned into
an OpenAI error body by the router's own route class, so the host app needs
no exception handlers of ours.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings (a ``--runner pooling`` model
only; a pooling model answers the generation routes with a 400 naming the route, and a generative model
/v1/embeddings), POST /v1/responses (with GET, DELETE and
POST .../cancel of /v1/responses/{id} and GET .../input_items: ``serving_responses.py``), their two
``/render`` twins (vLLM's: the exact prompt token ids and sampling
parameters a generate request would submit, nothing generated), GET
/v1/models, POST /tokenize, POST /detokenize, POST /reset_prefix_cache
(these need ``Authorization: Bearer <key>`` with one of the keys, when keys
are set; with several keys each is a tenant with a prefix cache of its own,
see ``access.py``), GET
/health, GET /version (always open), GET /metrics (open unless
``metrics_require_api_key``).

The edge, before any work: a POST body must be ``Content-Type:
application/json`` (415 otherwise: a web page cannot drive the server with a
"simple" cross-origin request) and at most ``RequestLimits.max_body_bytes``
(413, checked on Content-Length and while a chunked body is read, never
reading past the limit); ``parse_json`` refuses lone surrogates and deep
nesting with a 400. CORS is off unless ``build_app`` gets ``allowed_origins``.

A client that disconnects aborts its request: streaming responses watch for
the disconnect while they send; non-streaming ones race the generation
against it.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from paged_runtime.config import (DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES,
                                  DEFAULT_RESPONSES_STORE_MAX_BYTES, DEFAULT_RESPONSES_STORE_MAX_ENTRIES, ServerConfig)
from paged_runtime.engine.client import EngineClient
from paged_runtime.lora.request import parse_lora_modules
from paged_runtime.entrypoints.openai.access import ApiKeys, HostGuard, Tenant, trusted_hosts
from paged_runtime.entrypoints.openai.drain import Drain, DrainMiddleware
from paged_runtime.entrypoints.openai.errors import (CLIENT_CLOSED_REQUEST, OpenAIError, bad_request, from_exception,
                                                    parse_json, payload_too_large, unsupported_media_type)
from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_runtime.entrypoints.openai.model_set import ModelSet
from paged_runtime.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                       EmbeddingRequest, LoadLoRAAdapterRequest, ModelNameRequest,
                                                       ResponsesRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from paged_runtime.entrypoints.openai.response_store import ResponseStore
from paged_runtime.entrypoints.openai.serving import OpenAIServing, RequestLimits, StreamingResult
from paged_runtime.entrypoints.openai.serving_chat import ChatOptions, ChatServing
from paged_runtime.entrypoints.openai.serving_completion import CompletionServing
from paged_runtime.entrypoints.openai.serving_embedding import EmbeddingServing
from paged_runtime.entrypoints.openai.serving_responses import ResponsesServing, StoredResponses

ModelT = TypeVar("ModelT", bound=BaseModel)


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


async def _parse(request: Request, model: type[ModelT], max_body_bytes: int) -> ModelT:
    """The body as ``model``, after the edge checks (see the module docstring); decoded on a worker
    thread, so a large body does not hold up the event loop."""
    _check_json_content_type(request)
    body = await read_body(request, max_body_bytes)
    return await anyio.to_thread.run_sync(_decode, body, model)


def _check_json_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        raise unsupported_media_type(content_type)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``limit`` bytes (nothing more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request(f"Invalid Content-Length header: {declared!r}")
        if int(declared) > limit:
            raise payload_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise payload_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(body: bytes, model: type[ModelT]) -> ModelT:
    data = parse_json(body)
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    return model.model_validate(data)


def authenticator(keys: ApiKeys) -> Callable[[Request], Tenant]:
    """A dependency: the caller's tenant from its ``Authorization`` header (a 401 without a valid key)."""

    def authenticate(request: Request) -> Tenant:
        return keys.authenticate(request.headers.get("authorization"))

    return authenticate


def app_options(server: ServerConfig, bind_host: str | None = None) -> dict[str, Any]:
    """``build_app``'s keywords from the server settings (the same for ``serve`` and both adapters); a chat
    option that cannot work (a tool-call parser missing) raises ValueError here, before any model loads.
    ``bind_host``: the address the server listens on, where it is known (the Host check depends on it)."""
    keys = ApiKeys.of(server)
    return {"api_key": keys, "allowed_hosts": trusted_hosts(bind_host, keys, server.allowed_hosts),
            "enable_prompt_tokens_details": server.enable_prompt_tokens_details,
            "allowed_origins": server.allowed_origins, "max_request_body_bytes": server.max_request_body_bytes,
            "max_prompts_per_request": server.max_prompts_per_request,
            "metrics_require_api_key": server.metrics_require_api_key, "chat_template": server.chat_template,
            "chat_options": ChatOptions(server.enable_auto_tool_choice, server.tool_call_parser,
                                        server.reasoning_parser),
            "responses_store_max_entries": server.responses_store_max_entries,
            "responses_store_max_bytes": server.responses_store_max_bytes,
            "lora_modules": server.lora_modules, "allow_runtime_lora_updating": server.allow_runtime_lora_updating,
            "dynamic_lora_loading_path": server.dynamic_lora_loading_path}


@dataclass(frozen=True)
class ModelRoutes:
    """One loaded model's route handlers, over its engine (``ModelSet.bind`` makes them per engine)."""
    engine: EngineClient
    completions: CompletionServing
    chat: ChatServing
    responses: ResponsesServing
    embeddings: EmbeddingServing

    def generating(self, route: str) -> None:
        """A 400 naming ``route`` when the model runs as a pooler (it has no generation to offer)."""
        if self.engine.config.is_pooling:
            raise bad_request(f"{route} needs a generative model; this model runs as a pooling model "
                              "(--runner pooling): use /v1/embeddings", code="unsupported_model")


def build_router(engine: EngineClient | ModelSet, served_model_names: Sequence[str] | None = None, *,
                 api_key: str | Sequence[str] | ApiKeys | None = None, registry: CollectorRegistry | None = None,
                 model_root: str | None = None, include_metrics: bool = True,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 metrics_require_api_key: bool = False, chat_template: str | None = None,
                 chat_options: ChatOptions | None = None, enable_prompt_tokens_details: bool = False,
                 responses_store_max_entries: int = DEFAULT_RESPONSES_STORE_MAX_ENTRIES,
                 responses_store_max_bytes: int = DEFAULT_RESPONSES_STORE_MAX_BYTES,
                 enable_lora: bool | None = None, lora_modules: Sequence[str] | None = None,
                 allow_runtime_lora_updating: bool = False, dynamic_lora_loading_path: str | None = None
                 ) -> APIRouter:
    """All routes over ``engine``, or over each model of a ``ModelSet`` (``model_set.py``: a request goes to the
    model it names; ``served_model_names`` and ``model_root`` then come from the set). ``chat_template``:
    Jinja text that replaces the tokenizer's chat template (chat completions and /tokenize;
    ``--chat-template``); ``chat_options``: the chat route's tool calling and reasoning settings.
    ``registry`` is what /metrics shows (default: the global REGISTRY); hosts with a /metrics of their own
    (KServe) pass ``include_metrics=False`` and share the registry. ``max_request_body_bytes`` (413 beyond)
    and ``max_prompts_per_request`` (a completions ``prompt`` list; 400 beyond) bound one request;
    ``metrics_require_api_key`` puts /metrics behind the key; ``enable_prompt_tokens_details``: usage reports
    ``cached_tokens``. ``responses_store_*``: the bounds of the stored responses of /v1/responses
    (``response_store.py``; 0: nothing is stored). LoRA adapters (``lora_adapters.py``): ``lora_modules``
    (--lora-modules), ``allow_runtime_lora_updating`` (the load / unload routes), ``dynamic_lora_loading_path``;
    ``enable_lora`` None: whether the engines serve LoRA (their configs say)."""
    from paged_runtime import __version__
    models = engine if isinstance(engine, ModelSet) else ModelSet.single(
        engine, served_model_names or engine.config.served_model_names, model_root or engine.model_root)
    limits = RequestLimits(max_request_body_bytes, max_prompts_per_request)
    stored = StoredResponses(ResponseStore(responses_store_max_entries, responses_store_max_bytes))

    adapters = LoRAAdapters([m.names[0] for m in models.models], parse_lora_modules(lora_modules or []),
                            _serves_lora(models) if enable_lora is None else enable_lora,
                            allow_runtime_lora_updating, dynamic_lora_loading_path)

    def make_routes(model_engine: EngineClient, names: list[str]) -> ModelRoutes:
        common = dict(prompt_tokens_details=enable_prompt_tokens_details, adapters=adapters)
        return ModelRoutes(
            model_engine, CompletionServing(model_engine, names, limits, **common),
            ChatServing(model_engine, names, limits, chat_template, chat_options, **common),
            ResponsesServing(model_engine, names, limits, chat_template, chat_options, responses=stored, **common),
            EmbeddingServing(model_engine, names, limits, adapters=adapters))

    models.bind(make_routes)
    created = int(time.time())
    router = APIRouter(route_class=OpenAIRoute)
    router.lora_adapters = adapters  # for hosts that serve the adapters on routes of their own (KServe, Ray)

    async def read_static_adapters() -> None:  # at start-up: a --lora-modules adapter that cannot run fails it
        await adapters.check_static(models.loaded_engine)
    router.on_startup.append(read_static_adapters)
    keys = api_key if isinstance(api_key, ApiKeys) else ApiKeys(api_key)
    authenticate = authenticator(keys)
    auth = [Depends(authenticate)]
    max_body = limits.max_body_bytes

    async def parse_as(request: Request, model: type[ModelT], tenant: Tenant) -> ModelT:
        body = await _parse(request, model, max_body)
        body.cache_salt = tenant.cache_salt(body.cache_salt)
        return body

    @contextlib.asynccontextmanager
    async def routes_for(requested: str | None) -> AsyncIterator[ModelRoutes]:
        """``models.use`` of the model a request names, or of an adapter's base model (the adapter read first,
        where it loads on first use: ``lora_adapters.py``)."""
        base, adapter = adapters.split(requested)
        async with models.use(base) as routes:
            if adapter is not None:
                await adapters.ensure(routes.engine, base, adapter)
            yield routes

    async def answer(request: Request, model: str | None, work: Callable[[ModelRoutes], Awaitable[Any]]) -> Response:
        """``work`` on the routes of the model the request names (loaded first, if need be), raced against the
        client's disconnect; a generate route's SSE stream or whole body, or an embeddings body."""
        async def run() -> Response:
            async with routes_for(model) as routes:
                result = await work(routes)
            return SSEResponse(result) if isinstance(result, StreamingResult) else JSONResponse(result)

        response = await _until_disconnect(request, run())
        return response or Response(status_code=CLIENT_CLOSED_REQUEST)

    def generate(route: str, create: Callable[[ModelRoutes], Callable[..., Awaitable[Any]]], *args: Any):
        """``work`` for ``answer``: ``route``'s create method on a generative model."""
        async def work(routes: ModelRoutes) -> Any:
            routes.generating(route)
            return await create(routes)(*args)
        return work

    @router.post("/v1/completions")
    async def create_completion(request: Request, tenant: Tenant = Depends(authenticate)) -> Response:
        body = await parse_as(request, CompletionRequest, tenant)
        return await answer(request, body.model, generate("/v1/completions", lambda r: r.completions.create, body))

    @router.post("/v1/chat/completions")
    async def create_chat_completion(request: Request, tenant: Tenant = Depends(authenticate)) -> Response:
        body = await parse_as(request, ChatCompletionRequest, tenant)
        return await answer(request, body.model, generate("/v1/chat/completions", lambda r: r.chat.create, body))

    @router.post("/v1/responses")
    async def create_response(request: Request, tenant: Tenant = Depends(authenticate)) -> Response:
        body = await parse_as(request, ResponsesRequest, tenant)
        return await answer(request, body.model,
                            generate("/v1/responses", lambda r: r.responses.create, body, tenant.owner))

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request, tenant: Tenant = Depends(authenticate)) -> dict:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request("streaming a stored response is not supported: GET it without stream",
                              param="stream", code="unsupported_parameter")
        return stored.retrieve(tenant.owner, response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, tenant: Tenant = Depends(authenticate), limit: int = 20,
                               order: str = "desc", after: str | None = None, before: str | None = None) -> dict:
        return stored.input_items(tenant.owner, response_id, limit, order, after, before)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, tenant: Tenant = Depends(authenticate)) -> dict:
        return stored.delete(tenant.owner, response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, tenant: Tenant = Depends(authenticate)) -> dict:
        return await stored.cancel(tenant.owner, response_id)

    @router.post("/v1/embeddings")
    async def create_embedding(request: Request, tenant: Tenant = Depends(authenticate)) -> Response:
        body = await parse_as(request, EmbeddingRequest, tenant)
        return await answer(request, body.model, lambda routes: routes.embeddings.create(body))

    @router.post("/v1/completions/render")
    async def render_completion(request: Request, tenant: Tenant = Depends(authenticate)) -> list:
        body = await parse_as(request, CompletionRequest, tenant)
        async with routes_for(body.model) as routes:
            return await routes.completions.render_request(body)

    @router.post("/v1/chat/completions/render")
    async def render_chat_completion(request: Request, tenant: Tenant = Depends(authenticate)) -> dict:
        body = await parse_as(request, ChatCompletionRequest, tenant)
        async with routes_for(body.model) as routes:
            return await routes.chat.render_request(body)

    @router.get("/v1/models", dependencies=auth)
    async def list_models() -> dict:
        return {"object": "list", "data": models.listing(created) + adapters.listing(created)}

    if adapters.allow_updates:
        @router.post("/v1/load_lora_adapter", dependencies=auth)
        async def load_lora_adapter(request: Request) -> Response:
            """vLLM's route: read, check and register an adapter (400 with the reason where it cannot run)."""
            body = await _parse(request, LoadLoRAAdapterRequest, max_body)
            async with models.use(body.base_model_name or adapters.base_names[0]) as routes:
                await adapters.load(routes.engine, body.lora_name, body.lora_path, body.base_model_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @router.post("/v1/unload_lora_adapter", dependencies=auth)
        async def unload_lora_adapter(request: Request) -> Response:
            """vLLM's route: new requests for the adapter get 404 at once; those running finish."""
            body = await _parse(request, UnloadLoRAAdapterRequest, max_body)
            await adapters.unload(models.loaded_engine, body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    if models.can_unload:
        @router.post("/models/load", dependencies=auth)
        async def load_model(request: Request) -> dict:
            """llama.cpp's route: load a model now (unloading the least recently used idle one if need be)."""
            name = _model_field(await _parse(request, ModelNameRequest, max_body))
            await _until_disconnect(request, models.load(name))
            return {"success": True}

        @router.post("/models/unload", dependencies=auth)
        async def unload_model(request: Request) -> dict:
            """llama.cpp's route: unload an idle model now (409 while it has requests in flight)."""
            await models.unload(_model_field(await _parse(request, ModelNameRequest, max_body)))
            return {"success": True}

    @router.get("/health")
    async def health() -> Response:
        models.check_health()
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict:
        """vLLM's ``version``, and ``cpu_kernels``: the compiled CPU kernels the loaded engines run
        (``EngineClient.cpu_kernels`` of the first that runs any: a server's engines share one cpu_isa), else
        null."""
        kernels = next((k for e in models.loaded_engines() if (k := e.cpu_kernels) is not None), None)
        return {"version": __version__, "cpu_kernels": kernels}

    @router.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache() -> Response:
        """vLLM's route: forget every cached prefix of every loaded model (KV-cache event subscribers get
        AllBlocksCleared)."""
        for model_engine in models.loaded_engines():
            model_engine.reset_prefix_cache()
        return Response(status_code=200)

    @router.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict:
        body = await _parse(request, TokenizeRequest, max_body)
        async with routes_for(body.model) as routes:
            return await routes.chat.tokenizer_worker.run(_tokenize, routes.chat, body)

    @router.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict:
        body = await _parse(request, DetokenizeRequest, max_body)
        async with routes_for(body.model) as routes:
            return await routes.chat.tokenizer_worker.run(_detokenize, routes.chat, body)

    if include_metrics:
        source = registry if registry is not None else REGISTRY

        @router.get("/metrics", dependencies=auth if metrics_require_api_key else [])
        async def metrics() -> Response:
            return Response(generate_latest(source), media_type=CONTENT_TYPE_LATEST)

    return router


def _serves_lora(models: ModelSet) -> bool:
    return any(m.engine is not None and m.engine.config.enable_lora for m in models.models)


def _model_field(req: ModelNameRequest) -> str:
    if not req.model:
        raise bad_request("'model' names the model", param="model")
    return req.model


def _tokenize(serving: ChatServing, req: TokenizeRequest) -> dict:
    """/tokenize's body; runs on ``serving``'s tokenizer worker."""
    serving.resolve_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
    tokenizer = serving.tokenizer_worker.tokenizer
    if req.messages is not None:
        text, _ = serving.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs)
        token_ids = serving.tokenizer_worker.encode(text, "messages", add_special_tokens=bool(req.add_special_tokens))
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        token_ids = serving.tokenizer_worker.encode(req.prompt, add_special_tokens=add_special)
    return {"count": len(token_ids), "max_model_len": serving.engine.max_model_len, "tokens": token_ids,
            "token_strs": tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None}


def _detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict:
    """/detokenize's body; runs on ``serving``'s tokenizer worker."""
    serving.resolve_model(req.model)
    vocab_size = serving.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range for vocabulary size {vocab_size}", param="tokens")
    return {"prompt": serving.tokenizer_worker.tokenizer.decode(req.tokens)}


def build_app(engine: EngineClient | ModelSet, served_model_names: Sequence[str] | None = None, *,
              allowed_origins: Sequence[str] | None = None, drain: Drain | None = None,
              allowed_hosts: Sequence[str] | None = None, **router_options: Any) -> FastAPI:
    """A FastAPI app serving ``build_router``'s routes; it does not own the engine (the caller shuts it down).

    ``allowed_origins``: CORS for exactly these origins (Starlette's CORSMiddleware); None or empty: no
    CORS, so browsers refuse cross-origin reads and preflights. ``drain``: while it drains, every request is a
    503 ``server_shutting_down`` (see ``drain.py``). ``allowed_hosts``: answer only requests whose Host is a
    loopback name or one of these (``access.HostGuard``; ``trusted_hosts`` says when); None: any Host.
    The other keywords are ``build_router``'s.
    """
    from paged_runtime import __version__
    app = FastAPI(title="paged-runtime OpenAI-compatible server", version=__version__)
    router = build_router(engine, served_model_names, **router_options)
    app.include_router(router)
    app.state.lora_adapters = router.lora_adapters  # the adapters this app serves (lora_adapters.LoRAAdapters)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return OpenAIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return OpenAIError(405, f"method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed").response()

    if drain is not None:
        app.add_middleware(DrainMiddleware, drain=drain)
    if allowed_hosts is not None:  # outermost: a foreign Host is refused before anything else runs
        app.add_middleware(HostGuard, allowed=allowed_hosts)
    return app
