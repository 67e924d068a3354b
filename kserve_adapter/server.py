"""``python -m kserve_adapter``: wires the model, the OpenAI routes and KServe's ModelServer together.

One process, one uvicorn worker, one engine per model (several models:
``--model A --model B`` or ``--models-dir``, each a KServe model of its own name on v1/v2, all behind the
OpenAI routes, which pick one by the request's ``model``). The HTTP server comes up at
once (``/`` answers, the model's ready routes say 503) and the engine loads
beside it. SIGTERM or SIGINT drains (``paged_runtime.entrypoints.openai.drain``):
every new request, KServe's health and ready routes included, is a 503;
requests in flight get ``--shutdown-timeout`` seconds, then the engine fails
the rest (OpenAI streams end with an error event and ``[DONE]``, other
requests get a 503 body); then uvicorn stops, KServe unloads the model and
the process exits 0. A model that fails to build exits 1.

Access: with ``--api-key``, every route but the probes (``/``, the v2 health
routes, ``GET /v1/models/NAME``, ``/v2/models/NAME/ready``) and, unless
``--metrics-require-api-key``, ``/metrics`` needs the key
(``ApiKeyMiddleware``; the OpenAI routes check it themselves, with their own
error body); several keys are tenants with prefix caches of their own on
every route. ``--allowed-hosts`` limits the Host headers answered
(``access.HostGuard``; bound to a loopback ``--host`` without a key, loopback
names only).

Request bounds: ``--max-request-body-bytes`` holds for every route
(``BodyLimitMiddleware``: KServe reads its v1/v2 bodies itself, so the limit
sits in front of its app; the OpenAI routes check it themselves, with their
own error body), and ``--max-prompts-per-request`` for the v1 ``instances``
and the v2 ``text_input`` as for a completions ``prompt`` list.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kserve import ModelServer
from kserve.logging import KSERVE_LOGGER_DATE_FORMAT, KSERVE_LOGGER_FORMAT
from kserve.model_server import app as kserve_app
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kserve_adapter.args import parse_args
from kserve_adapter.lora import LoRARepository
from kserve_adapter.model import PagedRuntimeModel
from kserve_adapter.openai_routes import OpenAIRoutes, is_openai_path, mount_openai_routes
from paged_runtime.config import EngineConfig, ServerConfig
from paged_runtime.engine.client import EngineDeadError, EngineOverloadedError
from paged_runtime.entrypoints.cli import engine_configs, make_engine, server_config
from paged_runtime.entrypoints.openai import app_options
from paged_runtime.entrypoints.openai.access import ApiKeys, HostGuard
from paged_runtime.entrypoints.openai.drain import Drain, DrainMiddleware, GracefulShutdown
from paged_runtime.entrypoints.openai.errors import OpenAIError, payload_too_large
from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_runtime.entrypoints.openai.serving import RequestLimits
from paged_runtime.lora.request import parse_lora_modules

logger = logging.getLogger("kserve_adapter")


class AdapterModelServer(ModelServer):
    """KServe's ModelServer, binding ``host`` instead of the 0.0.0.0 its REST server hard-codes, and
    draining on SIGTERM/SIGINT instead of uvicorn's stop-then-cancel (see the module docstring).

    ``ModelServer.start()`` builds the REST server, then calls ``setup_event_loop()`` before anything
    runs: the one point where the uvicorn config and server can still be changed. ``drain`` gates
    KServe's app (``install_drain``); the signal handler goes on the uvicorn server, which installs it
    when it starts serving (KServe's own handler stays for SIGQUIT and is run by hand after the drain).
    """

    def __init__(self, host: str, shutdown_timeout: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.shutdown_timeout = shutdown_timeout
        self.drain = Drain()

    def install_drain(self, app: FastAPI) -> None:
        app.add_middleware(DrainMiddleware, drain=self.drain)

    def setup_event_loop(self) -> None:
        if self._rest_server is not None:
            self._rest_server.config.host = self.host
            uvicorn_server = self._rest_server._server

            def stop_serving(sig: int) -> None:
                uvicorn_server.should_exit = True
                self.stop(sig)  # KServe's own stop: unloads the models (their engines), stops the other servers

            GracefulShutdown(self.drain, self.shutdown_timeout, self.stop_engines, stop_serving).install(uvicorn_server)
        super().setup_event_loop()

    def stop_engines(self) -> None:
        """Fail what the models still run (``drain_then_stop`` calls it, in a thread, after the timeout)."""
        for model in list(self.registered_models.get_models().values()):
            if model.engine:
                model.stop_engine()


class _BodyTooLarge(Exception):
    """Raised into the app from ``receive`` once the body passed the limit."""


class BodyLimitMiddleware:
    """ASGI: a request body over ``max_body_bytes`` is a 413 ``{"error": message}`` (KServe's error shape, the
    runtime's ``payload_too_large`` message), never read past the limit.

    A Content-Length over the limit is answered before the app runs; a body without one (chunked) is
    counted as the app reads it: the 413 goes out when the limit is passed, the app's read raises, and
    whatever the app answers after that is dropped. A body within the limit, and every response (streams
    included), passes untouched. The OpenAI routes are left to their own check of the same limit.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_openai_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            await self.too_large()(scope, receive, send)
            return
        received, started, answered = 0, False, False

        async def counting_receive() -> Message:
            nonlocal received, answered
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if not started:  # else the app's response is under way: only cutting it short is left
                        await self.too_large()(scope, receive, send)
                        answered = True
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if answered:
                return  # the app's answer to a cut-off body: the client has its 413
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not answered:
                raise

    def too_large(self) -> JSONResponse:
        return JSONResponse({"error": payload_too_large(self.max_body_bytes).message}, status_code=413)


# KServe's probes: the root, v2 liveness/readiness, v1 model readiness (GET /v1/models/NAME) and v2 model readiness.
PROBE_PATHS = re.compile(r"^/(?:|v2/health/(?:live|ready)|v1/models/[^/:]+|v2/models/[^/]+(?:/versions/[^/]+)?/ready)$")


class ApiKeyMiddleware:
    """ASGI: KServe's own routes need one of the API keys, except its probes (and ``/metrics`` when
    ``open_metrics``); a 401 in KServe's error shape otherwise. The OpenAI routes check the key themselves."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_metrics: bool) -> None:
        self.app = app
        self.keys = keys
        self.open_metrics = open_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.is_open(scope["method"], scope["path"]):
            try:
                self.keys.authenticate(Headers(scope=scope).get("authorization"))
            except OpenAIError as e:
                await JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def is_open(self, method: str, path: str) -> bool:
        if is_openai_path(path) or (path == "/metrics" and self.open_metrics):
            return True
        return method in ("GET", "HEAD") and PROBE_PATHS.match(path) is not None


def install_body_limit(app: FastAPI, max_body_bytes: int) -> None:
    """Every request to ``app`` reads at most ``max_body_bytes`` of body (``BodyLimitMiddleware``)."""
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)


def add_engine_error_handlers(app: FastAPI) -> None:
    """KServe-style 503 bodies for the v1/v2 routes when the engine is full or gone (KServe would say 500)."""

    async def overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": str(exc.retry_after)})

    async def dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

    app.add_exception_handler(EngineOverloadedError, overloaded)
    app.add_exception_handler(EngineDeadError, dead)


def configure_logging(args: argparse.Namespace, server: ServerConfig) -> None:
    """The runtime's log lines (start-up, throughput) in KServe's format, unless KServe's logging is off."""
    if not args.configure_logging:
        return
    for name in ("paged_runtime", "kserve_adapter"):
        log = logging.getLogger(name)
        log.setLevel(server.log_level.upper())
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(KSERVE_LOGGER_FORMAT, KSERVE_LOGGER_DATE_FORMAT))
            log.addHandler(handler)
            log.propagate = False


def build_server(args: argparse.Namespace, server: ServerConfig,
                 repository: LoRARepository | None = None) -> AdapterModelServer:
    return AdapterModelServer(
        host=args.host, shutdown_timeout=server.shutdown_timeout, http_port=args.http_port, grpc_port=args.grpc_port,
        workers=args.workers, registered_models=repository,
        max_threads=args.max_threads, max_asyncio_workers=args.max_asyncio_workers, enable_grpc=args.enable_grpc,
        enable_docs_url=args.enable_docs_url, enable_latency_logging=args.enable_latency_logging,
        access_log_format=args.access_log_format, event_loop=args.event_loop,
        timeout_keep_alive=args.timeout_keep_alive, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)


def request_limits(server: ServerConfig) -> RequestLimits:
    return RequestLimits(server.max_request_body_bytes, server.max_prompts_per_request)


def build_model(name: str, config: EngineConfig, server: ServerConfig) -> PagedRuntimeModel:
    """The KServe model ``name``, with the configured request limits and keys; its engine is built from
    ``config`` when it starts."""
    return PagedRuntimeModel(name, config.served_model_names, lambda: make_engine(config, server),
                             request_limits(server), ApiKeys.of(server))


def build_models(args: argparse.Namespace, configs: list[EngineConfig], server: ServerConfig) -> list[PagedRuntimeModel]:
    """One KServe model per engine config: ``--model_name`` for one model, each one's served name for several."""
    if not isinstance(args.model, list):  # one model (parse_args leaves a list for several)
        return [build_model(args.model_name, configs[0], server)]
    return [build_model(config.served_model_names[0], config, server) for config in configs]


def planned_adapters(configs: list[EngineConfig], server: ServerConfig) -> LoRAAdapters:
    """The ``--lora-modules`` adapters over the models ``configs`` serve, as the OpenAI app will register them;
    ValueError for flags that cannot work (an adapter without --enable-lora, over a model not served, named
    like one), before anything loads."""
    return LoRAAdapters([config.served_model_names[0] for config in configs],
                        parse_lora_modules(server.lora_modules or []), any(c.enable_lora for c in configs),
                        server.allow_runtime_lora_updating, server.dynamic_lora_loading_path)


def install_access(app: FastAPI, keys: ApiKeys, allowed_hosts: list[str] | None, server: ServerConfig) -> None:
    """The key check on KServe's routes (``ApiKeyMiddleware``), and the Host check on every route where
    ``allowed_hosts`` is not None (``app_options`` says when)."""
    if keys.enabled:
        app.add_middleware(ApiKeyMiddleware, keys=keys, open_metrics=not server.metrics_require_api_key)
    if allowed_hosts is not None:
        app.add_middleware(HostGuard, allowed=allowed_hosts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        server = server_config(args)
        configs = engine_configs(args, server)
        options = app_options(server, bind_host=args.host)  # a chat option that cannot work fails before loading
        allowed_hosts = options.pop("allowed_hosts")  # checked on KServe's whole app, the OpenAI one included
        planned = planned_adapters(configs, server)
        # From the configs, as `serve` does: build_router's default reads the engines, which load later here.
        options["enable_lora"] = planned.enabled
    except ValueError as e:
        print(f"kserve_adapter: error: {e}", file=sys.stderr)
        return 2
    models = build_models(args, configs, server)
    routes = OpenAIRoutes(models, **options)
    model_server = build_server(args, server, LoRARepository(routes, planned))  # configures KServe's logging first
    configure_logging(args, server)
    for model in models:
        model.on_engine_up = routes.start  # the last one up builds the OpenAI app and checks the adapters
        model.load()
    mount_openai_routes(kserve_app, routes)
    add_engine_error_handlers(kserve_app)
    install_body_limit(kserve_app, server.max_request_body_bytes)
    install_access(kserve_app, options["api_key"], allowed_hosts, server)  # before any body is read
    model_server.install_drain(kserve_app)  # a draining server refuses before reading any body
    try:
        model_server.start(models)
    except Exception:
        logger.exception("the model server stopped on an error")
        return 1
    finally:
        for model in models:
            model.stop_engine()
    return 0
