"""``python -m kserve_adapter``: wires the model, the OpenAI routes and KServe's ModelServer together.

One process, one uvicorn worker, one engine. The HTTP server comes up at
once (``/`` answers, the model's ready routes say 503) and the engine loads
beside it. SIGTERM or SIGINT drains (``paged_runtime.entrypoints.openai.drain``):
every new request, KServe's health and ready routes included, is a 503;
requests in flight get ``--shutdown-timeout`` seconds, then the engine fails
the rest (OpenAI streams end with an error event and ``[DONE]``, other
requests get a 503 body); then uvicorn stops, KServe unloads the model and
the process exits 0. A model that fails to build exits 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kserve import ModelServer
from kserve.logging import KSERVE_LOGGER_DATE_FORMAT, KSERVE_LOGGER_FORMAT
from kserve.model_server import app as kserve_app

from kserve_adapter.args import parse_args
from kserve_adapter.model import PagedRuntimeModel
from kserve_adapter.openai_routes import OpenAIRoutes, mount_openai_routes
from paged_runtime.engine.client import EngineDeadError, EngineOverloadedError
from paged_runtime.entrypoints.cli import API_KEY_ENV, engine_config, make_engine
from paged_runtime.entrypoints.openai.drain import Drain, DrainMiddleware, GracefulShutdown

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


def add_engine_error_handlers(app: FastAPI) -> None:
    """KServe-style 503 bodies for the v1/v2 routes when the engine is full or gone (KServe would say 500)."""

    async def overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": str(exc.retry_after)})

    async def dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

    app.add_exception_handler(EngineOverloadedError, overloaded)
    app.add_exception_handler(EngineDeadError, dead)


def configure_logging(args: argparse.Namespace) -> None:
    """The runtime's log lines (start-up, throughput) in KServe's format, unless KServe's logging is off."""
    if not args.configure_logging:
        return
    for name in ("paged_runtime", "kserve_adapter"):
        log = logging.getLogger(name)
        log.setLevel(args.log_level.upper())
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(KSERVE_LOGGER_FORMAT, KSERVE_LOGGER_DATE_FORMAT))
            log.addHandler(handler)
            log.propagate = False


def build_server(args: argparse.Namespace) -> AdapterModelServer:
    return AdapterModelServer(
        host=args.host, shutdown_timeout=args.shutdown_timeout, http_port=args.http_port, grpc_port=args.grpc_port,
        workers=args.workers,
        max_threads=args.max_threads, max_asyncio_workers=args.max_asyncio_workers, enable_grpc=args.enable_grpc,
        enable_docs_url=args.enable_docs_url, enable_latency_logging=args.enable_latency_logging,
        access_log_format=args.access_log_format, event_loop=args.event_loop,
        timeout_keep_alive=args.timeout_keep_alive, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)


def edge_options(args) -> dict:
    """``build_app``'s HTTP-edge keywords from the shared runtime flags (as ``paged-runtime serve`` passes them)."""
    return {"allowed_origins": args.allowed_origins, "max_request_body_bytes": args.max_request_body_bytes,
            "max_prompts_per_request": args.max_prompts_per_request,
            "metrics_require_api_key": args.metrics_require_api_key}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = engine_config(args)
    except ValueError as e:
        print(f"kserve_adapter: error: {e}", file=sys.stderr)
        return 2
    server = build_server(args)  # configures KServe's logging first
    configure_logging(args)
    model = PagedRuntimeModel(args.model_name, args.served_model_name, lambda: make_engine(config, args))
    model.load()
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    mount_openai_routes(kserve_app, OpenAIRoutes(model, api_key, **edge_options(args)))
    add_engine_error_handlers(kserve_app)
    server.install_drain(kserve_app)
    try:
        server.start([model])
    except Exception:
        logger.exception("the model server stopped on an error")
        return 1
    finally:
        model.stop_engine()
    return 0
