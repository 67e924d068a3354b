"""The ``paged-runtime`` command (also ``python -m paged_runtime``).

``paged-runtime serve [MODEL]`` starts the OpenAI-compatible server with
vLLM's flag names, generated from the settings (``config.py``: every field of
``EngineConfig`` and ``ServerConfig`` that ``serve`` shows). MODEL is a Hugging
Face folder or a .gguf file; without it the embedded SmolLM2-135M-Instruct is
served. The API key may also come from ``PAGED_RUNTIME_API_KEY`` or, after it,
vLLM's ``VLLM_API_KEY``.

vLLM launch lines work as they are: ``--kv-cache-memory-bytes`` is
``--kv-cache-memory``, ``--allowed-origins`` also takes vLLM's JSON list
(``'["https://a"]'``), ``--disable-log-requests`` is accepted (this server
never logs requests' contents), ``--uvicorn-log-level`` sets uvicorn's level
apart from the runtime's.
"""
from __future__ import annotations

import argparse
import logging
import sys

from paged_runtime.config import EngineConfig, ServerConfig
from paged_runtime.settings import add_arguments

logger = logging.getLogger("paged_runtime.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-runtime", description="A vLLM-class LLM serving runtime.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)
    return parser


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL as vLLM's ``serve`` takes it (positional, or ``--model``), then every setting ``serve`` shows."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face folder or .gguf file (as --model); none: the embedded SmolLM2-135M-Instruct")
    add_arguments(p, (ServerConfig, EngineConfig), "serve")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed flags; ValueError for a combination the engine cannot run."""
    model = getattr(args, "model_tag", None) or getattr(args, "model", None)
    return EngineConfig.from_attributes(args, model=model)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig.from_attributes(args)


def run_serve(args: argparse.Namespace) -> int:
    try:
        config, server = engine_config(args), server_config(args)
    except ValueError as e:
        print(f"paged-runtime serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        from paged_runtime.entrypoints.openai import app_options
        options = app_options(server, bind_host=server.host)  # a flag that cannot work fails before loading
        engine = make_engine(config, server)
    except (ValueError, RuntimeError) as e:
        print(f"paged-runtime serve: error: {e}", file=sys.stderr)
        return 2
    try:
        serve_http(engine, config, server, options)
    finally:
        engine.shutdown()
    return 0


def make_engine(config: EngineConfig, server: ServerConfig, registry=None):
    """The AsyncEngine every front end serves: Prometheus metrics under the first served name (in ``registry``,
    default the process's), the periodic stats line unless turned off, the server's queue bound."""
    from paged_runtime.engine.async_engine import AsyncEngine
    from paged_runtime.metrics import LoggingStatLogger, PrometheusStatLogger
    stat_loggers = [PrometheusStatLogger(config.served_model_names[0], registry)]
    if not server.disable_log_stats:
        stat_loggers.append(LoggingStatLogger(server.log_stats_interval))
    return AsyncEngine.from_config(config, max_waiting_requests=server.max_waiting_requests,
                                   stat_loggers=stat_loggers, step_timeout=server.engine_step_timeout,
                                   registry=registry)


def serve_http(engine, config: EngineConfig, server: ServerConfig, options: dict) -> None:
    """Serve until SIGTERM/SIGINT, then drain (``entrypoints/openai/drain.py``): new requests get 503, those
    in flight get ``--shutdown-timeout`` seconds, the engine fails the rest with proper error responses."""
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from paged_runtime.entrypoints.openai import build_app
    from paged_runtime.entrypoints.openai.drain import Drain, GracefulShutdown
    names = config.served_model_names
    drain = Drain()
    app = build_app(engine, names, model_root=engine.model_root, drain=drain, **options)
    logger.info("serving %s on http://%s:%d/v1 (max_model_len %d%s)", ", ".join(names), server.host, server.port,
                engine.max_model_len, ", API key required" if options["api_key"].enabled else "")
    # Every admitted request has its response by the time uvicorn stops: its own grace is a backstop only.
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host=server.host, port=server.port,
                                                   log_level=server.uvicorn_log_level or server.log_level,
                                                   timeout_keep_alive=5, timeout_graceful_shutdown=5))
    GracefulShutdown(drain, server.shutdown_timeout, engine.shutdown,
                     on_drained=lambda sig: setattr(uvicorn_server, "should_exit", True)).install(uvicorn_server)
    uvicorn_server.run()
    if not uvicorn_server.started:  # e.g. the port is taken (uvicorn logged why): fail as uvicorn.run does
        sys.exit(STARTUP_FAILURE)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
