"""The two Serve deployments: a model replica that owns one engine, and the ingress of multi-replica mode.

``EngineReplica`` (deployed as ``PagedRuntimeServer``)
    Owns one ``AsyncEngine``, built in the replica's constructor (its step
    loop runs on its own thread), and the runtime's OpenAI app, built on the
    replica. In single-replica mode it is the application's ingress and Serve
    serves the app over HTTP (``__serve_build_asgi_app__``); in multi-replica
    mode ``forward`` runs the app for requests that come through a
    DeploymentHandle. Serve hooks:

    - ``check_health`` raises once the engine's step loop has died or
      stalled (``--engine-step-timeout``), so Serve replaces the replica,
      and while the replica drains;
    - ``reconfigure(user_config)`` applies ``max_num_seqs`` and
      ``max_waiting_requests`` live (raise ``max_ongoing_requests`` with
      ``max_num_seqs``: both are applied without restarting replicas);
    - ``record_autoscaling_stats`` feeds ``autoscaling.EngineAutoscalingPolicy``;
    - ``record_routing_stats`` feeds ``router.PrefixAffinityRouter``, with the LoRA adapters the
      replica's engine holds (``lora_adapters``: multiplexed routing, ``lora.py``).

    With ``enable_lora``, the app serves adapters as models (``lora_modules``, first use from
    ``dynamic_lora_loading_path``, the load / unload routes): each replica loads an adapter on its own
    first request for it.

    Shutdown: Serve stops routing to a stopping replica and waits for its
    requests up to ``graceful_shutdown_timeout_s`` (``shutdown_timeout``, set
    by the builder), then calls ``__del__``, which drains (new requests 503,
    those still in flight get ``shutdown_timeout``, then the engine fails the
    rest with an error event / a 503 body, see
    ``paged_runtime.entrypoints.openai.drain``) and shuts the engine down.
    Serve gives user code no notice when its drain starts, so a request still
    running when Serve kills the replica is cut by Ray; in multi-replica mode
    the ingress ends it with an error (below).

``OpenAIIngress`` (deployed as ``PagedRuntimeIngress``)
    Forwards every HTTP request, unparsed, through a streaming handle to the
    model deployment, with the prompt text as the routing key; streams the
    response back. With several models (one deployment each) it picks the
    deployment by the body's ``model``, and answers ``GET /v1/models`` and
    ``/health`` from every deployment's. With LoRA (``lora.AdapterNames``), a ``model`` that is no served
    base name goes to its base's deployment (``base:adapter``; an adapter named alone: the first model's),
    whose replica decides whether the adapter exists, and the adapter's name goes to the router; ``GET
    /v1/models`` adds the adapter folders any replica would load. When the model deployment's queue is
    full it answers 429 with ``Retry-After`` in OpenAI's error shape. A client that goes away
    cancels the handle call, which the replica sees as a disconnect. A model
    replica that dies or is killed mid-request (Serve's graceful shutdown
    timeout) never cuts the client off: a stream ends with an error event
    and ``data: [DONE]``, any other response is a 503 with an OpenAI body.

Nothing here imports torch at module level: the ingress replica and the driver
import this module; only a model replica's constructor loads the runtime.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from functools import cached_property
from typing import Any

from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_runtime.config import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerConfig
from paged_runtime.entrypoints.openai.access import ApiKeys
from paged_runtime.entrypoints.openai.api import read_body  # torch-free, as the ingress needs
from paged_runtime.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found
from rayserve_adapter.args import AppArgs, parse_args
from rayserve_adapter.asgi import ForwardedRequest, ResponseStart, stream_asgi
from rayserve_adapter.autoscaling import KV_CACHE_USAGE, NUM_RUNNING, NUM_WAITING
from rayserve_adapter.kv_router import KV_BLOCK_SIZE_STAT, KV_EVENTS_ENDPOINT_STAT, topic_of
from rayserve_adapter.lora import LORA_ADAPTERS_STAT, AdapterNames, unique_by_id
from rayserve_adapter.render import PromptRenderer
from rayserve_adapter.router import json_object, keyed, prompt_key

MODEL_DEPLOYMENT = "PagedRuntimeServer"
INGRESS_DEPLOYMENT = "PagedRuntimeIngress"
LIVE_SETTINGS = frozenset({"max_num_seqs", "max_waiting_requests"})  # what reconfigure applies
HTTP_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
SSE_DONE = b"data: [DONE]\n\n"

logger = logging.getLogger("rayserve_adapter")


class EngineReplica:
    """One engine per replica (see the module docstring). Plain Python: tests run it without Ray."""

    def __init__(self, args: AppArgs | dict[str, Any] | None = None) -> None:
        from prometheus_client import CollectorRegistry

        from paged_runtime.engine.client import EngineClient
        from paged_runtime.entrypoints.cli import make_engine
        from paged_runtime.entrypoints.openai.drain import Drain
        self.args = parse_args(args)
        logging.getLogger("paged_runtime").setLevel(self.args.log_level.upper())
        self.drain = Drain()  # gates the OpenAI app: 503 for new requests once graceful_shutdown() began
        self.registry = CollectorRegistry()  # this replica's /metrics shows this replica's engine only
        self.replica_id = _replica_id()
        self.engine: EngineClient = make_engine(self.args.engine_config(topic_of(self.replica_id), _node_ip()),
                                                self.args.server_config(), self.registry)

    @cached_property
    def asgi_app(self):
        from paged_runtime.entrypoints.openai import build_app
        return build_app(self.engine, self.args.served_model_names, registry=self.registry,
                         model_root=self.engine.model_root, drain=self.drain, enable_lora=self.args.enable_lora,
                         **self.args.app_options())

    def __serve_build_asgi_app__(self):
        return self.asgi_app

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """A request from the ingress: the ResponseStart, then the body in chunks (closing it aborts)."""
        async with contextlib.aclosing(stream_asgi(self.asgi_app, request)) as parts:  # closing us closes it
            async for part in parts:
                yield part

    def render_spec(self) -> tuple[object, str | None, int]:
        """What the ingress renders prompts with (``render.PromptRenderer``): the tokenizer, the chat template
        (None: the tokenizer's) and ``max_model_len``."""
        return self.engine.tokenizer, self.args.server_config().chat_template, self.engine.max_model_len

    def check_health(self) -> None:
        """Raises once the engine is dead or stalled (Serve replaces the replica), or while it drains (not ready)."""
        if self.drain.draining:
            raise RuntimeError("the replica is draining")
        self.engine.check_health()

    def reconfigure(self, user_config: dict[str, Any] | None) -> None:
        config = dict(user_config or {})
        unknown = sorted(set(config) - LIVE_SETTINGS)
        if unknown:
            raise ValueError(f"user_config keys {unknown} cannot be changed live; known: {sorted(LIVE_SETTINGS)}")
        if "max_num_seqs" in config:
            self.engine.set_max_num_seqs(int(config["max_num_seqs"]))
        if "max_waiting_requests" in config:
            self.engine.set_max_waiting_requests(config["max_waiting_requests"])

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.engine.stats
        return {NUM_WAITING: stats.num_waiting, KV_CACHE_USAGE: stats.kv_cache_usage, NUM_RUNNING: stats.num_running}

    def record_routing_stats(self) -> dict[str, Any]:
        """The engine's state for the router (KV usage breaks its last ties) and for operators: in
        multi-replica mode /metrics reaches one replica at a time, these stats reach each one."""
        stats = self.engine.stats
        aborted = self.registry.get_sample_value(
            "vllm:request_success_total", {"model_name": self.args.served_model_names[0], "finished_reason": "abort"})
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                KV_EVENTS_ENDPOINT_STAT: self.engine.kv_events_endpoint,
                KV_BLOCK_SIZE_STAT: self.engine.config.block_size,
                "kv_cache_usage": stats.kv_cache_usage, "num_prefix_queries": stats.num_prefix_queries,
                "num_prefix_hits": stats.num_prefix_hits, "num_preemptions": stats.num_preemptions,
                "num_aborted_requests": int(aborted or 0), "healthy": self.engine.is_healthy,
                LORA_ADAPTERS_STAT: self.asgi_app.state.lora_adapters.read_by(self.engine)}

    async def graceful_shutdown(self) -> None:
        """Drain (see the module docstring), then shut the engine down; runs on the replica's event loop."""
        from paged_runtime.entrypoints.openai.drain import drain_then_stop
        engine = self.__dict__.get("engine")  # absent if the constructor failed
        if engine is None:
            return
        await drain_then_stop(self.drain, self.args.shutdown_timeout, engine.shutdown)
        await asyncio.to_thread(engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine now (requests in flight fail with EngineDeadError)."""
        engine = self.__dict__.get("engine")  # absent if the constructor failed
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        self.shutdown()


def _replica_id() -> str:
    """This replica's unique id under Serve (its KV events' topic); "local" for a replica made by hand."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (tests build one directly)
        return "local"


def _node_ip() -> str:
    """This node's address in the Ray cluster (where Ray's own services listen); 127.0.0.1 outside Ray."""
    import ray
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class ServeEngineReplica(EngineReplica):
    """``EngineReplica`` as Serve runs it: Serve awaits an async ``__del__`` on the replica's loop, where the
    drain can let responses finish (a plain object keeps the synchronous one: the garbage collector
    cannot await)."""

    async def __del__(self) -> None:
        await self.graceful_shutdown()


class ModelBackend:
    """The ingress's view of one model deployment: its handles and its prompt renderer (KV-event routing)."""

    def __init__(self, handle: DeploymentHandle, render_tokens: bool) -> None:
        self.model = handle.options(stream=True)
        self.calls = handle.options(stream=False)
        self.render_tokens = render_tokens
        self.renderer: PromptRenderer | None = None
        self._renderer_lock = asyncio.Lock()

    async def with_tokens(self, forwarded: ForwardedRequest) -> ForwardedRequest:
        """With KV-event routing, a generate request with its prompt token ids; unchanged where they cannot be
        had (the request then goes by prefix affinity)."""
        if not self.render_tokens or forwarded.routing_key is None:
            return forwarded
        renderer = self.renderer or await self._fetch_renderer()
        if renderer is None:
            return forwarded
        return dataclasses.replace(forwarded, routing_tokens=await renderer.tokens(forwarded.path, forwarded.body))

    async def _fetch_renderer(self) -> PromptRenderer | None:
        """A replica's tokenizer and template, once; None (tried again next time) if no replica could say."""
        async with self._renderer_lock:
            if self.renderer is None:
                try:
                    self.renderer = PromptRenderer(*await self.calls.render_spec.remote())
                except Exception as e:
                    logger.warning("no prompt renderer yet (%s: %s); routing by prefix affinity", type(e).__name__, e)
            return self.renderer


class OpenAIIngress:
    """The HTTP front of multi-replica and multi-model modes: forwards to the model deployments (see the module
    docstring)."""

    def __init__(self, model: DeploymentHandle | dict[str, DeploymentHandle],
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, render_tokens: bool = False,
                 server: ServerConfig | None = None, lora: AdapterNames | None = None) -> None:
        """``model``: the model deployment, or several by model name (a request goes to the one its ``model``
        names; ``server``'s API keys then guard the answers the ingress gives itself). ``render_tokens``: give
        the router each generate request's token ids (KV-event routing), rendered here with a replica's
        tokenizer and chat template (``render.py``; fetched on first use). ``lora``: the model deployments
        serve LoRA adapters (None: they do not)."""
        handles = model if isinstance(model, dict) else {None: model}
        self.backends = {name: ModelBackend(handle, render_tokens) for name, handle in handles.items()}
        self.keys = ApiKeys.of(server) if server is not None else ApiKeys()
        self.max_request_body_bytes = max_request_body_bytes  # the replica's limit: never buffer more than it takes
        self.lora = lora
        self.reads_model = len(self.backends) > 1 or lora is not None  # else the replica alone reads ``model``
        self.created = int(time.time())

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.proxy, methods=HTTP_METHODS)])

    async def proxy(self, request: Request) -> Response:
        try:
            forwarded, data = await _forwarded(request, self.max_request_body_bytes, self.reads_model)
            if forwarded.method == "GET" and self._asks_every_model(forwarded.path):
                return await self._from_every_model(forwarded)
            name = _model_in(data)
            backend = self._backend_for(forwarded, data is not None, name)
        except OpenAIError as e:  # a body over the limit, an unknown model: answered here, as the replica would
            return e.response()
        adapter = self.lora.adapter_of(name) if self.lora is not None else None
        if adapter is not None:
            forwarded = dataclasses.replace(forwarded, lora_name=adapter)
        return await self._send(backend, await backend.with_tokens(forwarded))

    def _asks_every_model(self, path: str) -> bool:
        """Whether the ingress answers a GET of ``path`` from every model deployment's answer (and, for
        /v1/models, the adapter folders)."""
        if path == "/v1/models" and self.lora is not None and self.lora.dynamic_path is not None:
            return True
        return len(self.backends) > 1 and path in ALL_MODELS_PATHS

    def _backend_for(self, forwarded: ForwardedRequest, readable: bool, name: str | None) -> ModelBackend:
        """The deployment of the model a request names (``readable``: its body is a JSON object, ``name`` its
        ``model``). With several models, a generate or embeddings request that names none is a 400 and an
        unknown name a 404 (after the API key check the replica would make), unless the models serve LoRA
        adapters: a name that is no model then goes to its base model's deployment (``lora.AdapterNames``),
        whose replica answers for it; any other request goes to the model it names, or the first."""
        first = next(iter(self.backends.values()))
        if len(self.backends) == 1:
            return first
        if name in self.backends:
            return self.backends[name]
        if not readable or (name is None and forwarded.path not in MODEL_ROUTES):
            return first  # a body the replica refuses, /tokenize without a model, ...: the replica's own answer
        if name is not None and self.lora is not None:  # an adapter, or no model: the replica says which
            return self.backends.get(self.lora.base_of(name), first)
        self.keys.authenticate(_header(forwarded, b"authorization"))
        if name is None:
            raise bad_request(f"this application serves {len(self.backends)} models: name one in 'model' (GET "
                              "/v1/models lists them)", param="model")
        raise model_not_found(name)

    async def _send(self, backend: ModelBackend, forwarded: ForwardedRequest) -> Response:
        stream: DeploymentResponseGenerator = backend.model.forward.remote(forwarded)
        handed_over = False
        try:
            start = await stream.__anext__()
            headers = start.end_to_end_headers()
            if (start.header("content-type") or "").startswith("text/event-stream"):
                handed_over = True  # the response body now owns the stream
                return StreamingResponse(_rest(stream), status_code=start.status, headers=headers)
            body = b"".join([chunk async for chunk in stream])
            handed_over = True
            return Response(body, status_code=start.status, headers=headers)
        except BackPressureError as e:
            handed_over = True
            return overloaded(e)
        except Exception as e:  # the model replica died or was killed before the response was complete
            logger.warning("the model replica failed a request: %s: %s", type(e).__name__, e)
            return JSONResponse(replica_gone(e), status_code=503)
        finally:
            if not handed_over:  # cancelled (the client left) or failed: the replica must abort too. Serve
                stream.cancel()  # propagates a cancelled request to its child calls; this does not rely on it

    async def _from_every_model(self, forwarded: ForwardedRequest) -> Response:
        """GET /v1/models (every model's entries, in order, then the adapter folders', each id once) or /health
        (healthy when every model is): the first answer that is not a 200 as it is, else the merged one."""
        answers = await asyncio.gather(*(self._send(b, forwarded) for b in self.backends.values()))
        failed = next((a for a in answers if a.status_code != 200), None)
        if failed is not None or forwarded.path == "/health":
            return failed or answers[0]
        data = [entry for answer in answers for entry in json.loads(answer.body)["data"]]
        if self.lora is not None:
            data += await asyncio.to_thread(self.lora.folder_entries, self.created)
        return JSONResponse({"object": "list", "data": unique_by_id(data)})


ALL_MODELS_PATHS = ("/v1/models", "/health")  # what a multi-model ingress asks every model deployment
MODEL_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                          "/v1/completions/render", "/v1/chat/completions/render"})  # a request must name a model


def _model_in(data: dict | None) -> str | None:
    """The ``model`` string of a body read as a JSON object, or None."""
    model = data.get("model") if data is not None else None
    return model if isinstance(model, str) and model else None


def _header(forwarded: ForwardedRequest, name: bytes) -> str | None:
    return next((value.decode("latin-1") for key, value in forwarded.headers if key.lower() == name), None)


async def _forwarded(request: Request, max_body_bytes: int,
                     reads_model: bool) -> tuple[ForwardedRequest, dict | None]:
    """The request as the model replica gets it, with its routing key, and its body as a JSON object: None
    for a body that is not one, or is not read (a POST's is where ``reads_model``, or for its routing key);
    parsed once for both."""
    scope = request.scope
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"  # the model replica's app is mounted at "/"
    body = await read_body(request, max_body_bytes)
    has_key = keyed(path, body)
    data = json_object(body) if request.method == "POST" and (has_key or reads_model) else None
    return ForwardedRequest(request.method, path, scope.get("query_string", b""), tuple(scope["headers"]), body,
                            prompt_key(data) if has_key else None), data


async def _rest(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The rest of an SSE stream; a model replica that fails mid-stream ends it with an error event and [DONE]."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except Exception as e:
        logger.warning("the model replica failed a stream: %s: %s", type(e).__name__, e)
        yield b"data: " + json.dumps(replica_gone(e), separators=(",", ":")).encode() + b"\n\n" + SSE_DONE
    finally:
        if not finished:
            stream.cancel()


def replica_gone(e: BaseException) -> dict:
    """OpenAI's error body for a request whose model replica stopped (the code the runtime uses for a dead engine)."""
    return {"error": {"message": f"the model replica stopped before the response was complete ({type(e).__name__})",
                      "type": "server_error", "param": None, "code": "engine_unavailable"}}


def overloaded(e: BackPressureError) -> JSONResponse:
    """Serve's backpressure as an OpenAI error body, with the status and Retry-After the deployment asks for."""
    headers = {} if e.retry_after_s is None else {"Retry-After": str(max(0, math.ceil(e.retry_after_s)))}
    body = {"error": {"message": f"the server is overloaded: {e.message} Retry later.", "type": "server_overloaded",
                      "param": None, "code": "rate_limit_exceeded" if e.status_code == 429 else "server_overloaded"}}
    return JSONResponse(body, status_code=e.status_code, headers=headers)


# The model deployment in its two roles (Serve allows one ASGI ingress per application): serving HTTP
# itself in single-replica mode, and behind PagedRuntimeIngress, reached through ``forward``, otherwise.
PagedRuntimeServer = serve.deployment(name=MODEL_DEPLOYMENT)(serve.ingress()(ServeEngineReplica))
PagedRuntimeBackend = serve.deployment(name=MODEL_DEPLOYMENT)(ServeEngineReplica)
PagedRuntimeIngress = serve.deployment(name=INGRESS_DEPLOYMENT)(serve.ingress()(OpenAIIngress))
