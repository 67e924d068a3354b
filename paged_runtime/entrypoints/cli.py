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
import functools
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


def model_paths(args: argparse.Namespace) -> list[str]:
    """The models named on the command line: MODEL, then every ``--model``."""
    given = getattr(args, "model", None)
    tag = getattr(args, "model_tag", None)
    return ([tag] if tag else []) + ([given] if isinstance(given, str) else list(given or []))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig of the one model the flags name; ValueError for a combination the engine cannot run (or for
    several models: ``engine_configs``)."""
    paths = model_paths(args)
    if len(paths) > 1:
        raise ValueError(f"{len(paths)} models are named; this front end serves one")
    return EngineConfig.from_attributes(args, model=paths[0] if paths else None)


def engine_configs(args: argparse.Namespace, server: ServerConfig) -> list[EngineConfig]:
    """One EngineConfig per model: the one model's, or with several models (``--model`` repeated,
    ``--models-dir``) each under its own name with its share of the KV budget (``kv_budget.shared_kv_budget``,
    unless ``--kv-cache-memory`` gives each its bytes)."""
    paths = model_paths(args)
    if len(paths) <= 1 and server.models_dir is None:
        return [engine_config(args)]
    if getattr(args, "served_model_name", None):
        raise ValueError("--served-model-name names one model; with several, each is served under its folder or "
                         "file name")
    from paged_runtime.entrypoints.openai.model_set import discover
    specs = discover(paths, server.models_dir)
    configs = [EngineConfig.from_attributes(args, model=spec.path, served_model_name=[spec.name]) for spec in specs]
    if getattr(args, "kv_cache_memory", None) is None:
        from paged_runtime.utils.devices import resolve_device
        from paged_runtime.worker.kv_budget import shared_kv_budget
        budget = shared_kv_budget(resolve_device(configs[0].device), server.max_loaded_models or len(configs))
        for config in configs:
            config.kv_cache_memory = budget
    return configs


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig.from_attributes(args)


def run_serve(args: argparse.Namespace) -> int:
    try:
        server = server_config(args)
        configs = engine_configs(args, server)
    except ValueError as e:
        print(f"paged-runtime serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        from paged_runtime.entrypoints.openai import app_options
        options = app_options(server, bind_host=server.host)  # a flag that cannot work fails before loading
        options["enable_lora"] = any(config.enable_lora for config in configs)
        served = make_engine(configs[0], server) if len(configs) == 1 else make_model_set(configs, server)
    except (ValueError, RuntimeError) as e:
        print(f"paged-runtime serve: error: {e}", file=sys.stderr)
        return 2
    try:
        serve_http(served, server, options)
    finally:
        served.shutdown()
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


def make_model_set(configs: list[EngineConfig], server: ServerConfig, registry=None):
    """Several models behind one server (``model_set.py``): each engine built by ``make_engine``, its metrics
    under its name; with ``--max-loaded-models`` loaded on first use, else all now (one failing fails the
    start). Raises ValueError / RuntimeError as ``make_engine`` does."""
    from paged_runtime.entrypoints.openai.model_set import ModelSet, ServedModel
    models = [ServedModel(config.served_model_names, config.model or "",
                          functools.partial(make_engine, config, server, registry)) for config in configs]
    model_set = ModelSet(models, server.max_loaded_models)
    if server.max_loaded_models is None:
        try:
            model_set.load_all_now()
        except BaseException:
            model_set.shutdown()
            raise
    return model_set


def serve_http(served, server: ServerConfig, options: dict) -> None:
    """Serve an engine, or a ModelSet, until SIGTERM/SIGINT, then drain (``entrypoints/openai/drain.py``): new
    requests get 503, those in flight get ``--shutdown-timeout`` seconds, the engine(s) fail the rest with proper
    error responses."""
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from paged_runtime.entrypoints.openai import build_app
    from paged_runtime.entrypoints.openai.drain import Drain, GracefulShutdown
    drain = Drain()
    app = build_app(served, drain=drain, **options)
    logger.info("serving %s on http://%s:%d/v1%s", ", ".join(_served_names(served)), server.host, server.port,
                " (API key required)" if options["api_key"].enabled else "")
    # Every admitted request has its response by the time uvicorn stops: its own grace is a backstop only.
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host=server.host, port=server.port,
                                                   log_level=server.uvicorn_log_level or server.log_level,
                                                   timeout_keep_alive=5, timeout_graceful_shutdown=5))
    GracefulShutdown(drain, server.shutdown_timeout, served.shutdown,
                     on_drained=lambda sig: setattr(uvicorn_server, "should_exit", True)).install(uvicorn_server)
    uvicorn_server.run()
    if not uvicorn_server.started:  # e.g. the port is taken (uvicorn logged why): fail as uvicorn.run does
        sys.exit(STARTUP_FAILURE)


def _served_names(served) -> list[str]:
    from paged_runtime.entrypoints.openai.model_set import ModelSet
    if isinstance(served, ModelSet):
        return [name for model in served.models for name in model.names]
    return served.config.served_model_names


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
