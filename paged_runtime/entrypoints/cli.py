"""The ``paged-runtime`` command (also ``python -m paged_runtime``).

``paged-runtime serve [MODEL]`` starts the OpenAI-compatible server with
vLLM's flag names. MODEL is a Hugging Face folder or a .gguf file; without
it the embedded SmolLM2-135M-Instruct is served. The API key may also come
from ``PAGED_RUNTIME_API_KEY`` or, after it, vLLM's ``VLLM_API_KEY``.

vLLM launch lines work as they are: ``--kv-cache-memory-bytes`` is
``--kv-cache-memory``, ``--allowed-origins`` also takes vLLM's JSON list
(``'["https://a"]'``), ``--disable-log-requests`` is accepted (this server
never logs requests' contents), ``--uvicorn-log-level`` sets uvicorn's level
apart from the runtime's.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger("paged_runtime.serve")

API_KEY_ENV = "PAGED_RUNTIME_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # read after the project's own variable
# The parsers' names, spelled out so --help needs no import of the routes (tested against their registries).
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral")
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")
# config.QUANTIZATIONS, without importing torch (tested equal)
QUANTIZATIONS = ("none", "int8", "int4", "fp8", "gguf", "gptq", "awq", "compressed-tensors")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")  # config.KV_CACHE_DTYPES, likewise (tested equal)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'2147483648', '2G', '2GiB', '512MiB' -> bytes (K/M/G/T are powers of 1024, as vLLM's --kv-cache-memory)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 2147483648, 512MiB or 2GiB, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def chat_template(text: str) -> str:
    """``--chat-template``: a file's contents, or the text itself when it is a Jinja template (as vLLM)."""
    path = Path(text).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in text for c in "{}\n"):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a readable file nor a Jinja template")


class ExtendOrigins(argparse.Action):
    """``--allowed-origins A B`` or vLLM's ``--allowed-origins '["A", "B"]'``: one flat list of origins."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        origins = []
        for value in values:
            if value.lstrip().startswith("["):
                try:
                    parsed = json.loads(value)
                except ValueError:
                    parsed = None
                if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
                    parser.error(f"{option_string}: {value!r} is not a JSON list of origins")
                origins += parsed
            else:
                origins.append(value)
        setattr(namespace, self.dest, origins)


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $PAGED_RUNTIME_API_KEY, else $VLLM_API_KEY; None: no key."""
    return args.api_key or os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-runtime", description="A vLLM-class LLM serving runtime.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)
    return parser


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face folder or .gguf file; None: the embedded SmolLM2-135M-Instruct")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--uvicorn-log-level", default=None,
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (its access log is at info); None: --log-level")
    add_runtime_arguments(p, server)


def add_runtime_arguments(p: argparse.ArgumentParser, server=None) -> None:
    """The flags every front end shares (``serve`` and the KServe adapter): model names, auth, backpressure,
    logging and the engine. ``server``: the argument group for the serving flags (default: a new "server" group)."""
    server = server if server is not None else p.add_argument_group("server")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use for the model; the first one labels the metrics")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer <key>' on /v1 routes, /tokenize and /detokenize "
                             f"(or set {API_KEY_ENV}, or vLLM's {VLLM_API_KEY_ENV})")
    server.add_argument("--max-waiting-requests", type=positive_int, default=None,
                        help="beyond this many queued requests, answer 503 with Retry-After; None: unbounded")
    server.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish (new ones get 503); "
                             "then the rest end with an error")
    server.add_argument("--max-request-body-bytes", type=parse_bytes, default=16 * 2**20,
                        help="larger request bodies get 413 (e.g. 16MiB: a full-context prompt many times over)")
    server.add_argument("--max-prompts-per-request", type=positive_int, default=256,
                        help="most prompts in one /v1/completions 'prompt' list (each is one engine request)")
    server.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN", action=ExtendOrigins,
                        help="enable CORS for exactly these origins (e.g. https://app.example.com, or vLLM's JSON "
                             "list '[\"https://a\"]'); None: no CORS")
    server.add_argument("--chat-template", type=chat_template, default=None, metavar="FILE_OR_JINJA",
                        help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    server.add_argument("--max-logprobs", type=non_negative_int, default=20,
                        help="most logprobs / top_logprobs / prompt_logprobs a request may ask for")
    server.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="default sampling parameters: 'auto' from the model's generation_config.json, 'vllm' "
                             "the runtime's own, or a folder holding a generation_config.json")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="accepted for vLLM launch lines; this server never logs requests' contents")
    server.add_argument("--metrics-require-api-key", action="store_true",
                        help="with --api-key, /metrics needs the key too (default: open for scrapers)")
    server.add_argument("--max-stop-strings", type=positive_int, default=64,
                        help="most stop strings one request may send (each is matched after every token)")
    server.add_argument("--max-stop-string-length", type=positive_int, default=512,
                        help="longest stop string a request may send, in characters")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto": parse tool calls out of the output with --tool-call-parser')
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSER_NAMES),
                        help="the model's tool-call format (hermes: Hermes / Qwen <tool_call>; llama3_json; mistral)")
    server.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSER_NAMES),
                        help="split <think>...</think> into reasoning_content; constraints apply after it")
    server.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    server.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats log lines")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = p.add_argument_group("engine")
    engine.add_argument("--tokenizer", default=None, help="tokenizer folder; None: the model's")
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "half", "float32", "float"])
    engine.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                        help="quantize the weights at load: int8 (W8A16, per output channel) or int4 (W4A16, "
                             "groups of 128, asymmetric) or fp8 (W8A8 float8_e4m3fn, per channel, activations per "
                             "token, through torch._scaled_mm). Quantized checkpoints are served in their own format, "
                             "detected: a .gguf's blocks (gguf), or config.json's gptq, awq, compressed-tensors "
                             "(W8A16, W4A16, FP8); naming another format is an error; none dequantizes a .gguf")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="the paged KV cache's elements: auto (the model's dtype), fp8 / fp8_e4m3 "
                             "(float8_e4m3fn, per-tensor scales), int8 (per token and head scales)")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    engine.add_argument("--max-model-len", type=positive_int, default=None)
    engine.add_argument("--max-num-seqs", type=positive_int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    engine.add_argument("--block-size", type=positive_int, default=16)
    engine.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_bytes, default=None,
                        help="bytes for the KV cache (e.g. 2GiB); None: a share of free memory")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                        help="split each layer over this many devices (one worker process each)")
    engine.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                        help="split the layers into this many stages (one worker process per device each)")
    engine.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None,
                        help="how the workers run: local processes (mp, the default on one machine) or Ray "
                             "actors (ray: any node; the default inside a Ray cluster)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="plain PyTorch: no CUDA graphs on a GPU, no compiled decode kernels on the CPU")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule step N+1 while step N runs (default: on for CUDA without speculative "
                             "decoding, off on the CPU)")
    engine.add_argument("--speculative-config", default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                             'or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'')


def engine_config(args: argparse.Namespace):
    """EngineConfig from the parsed flags; ValueError for a combination the engine cannot run."""
    from paged_runtime.config import EngineConfig
    return EngineConfig.from_attributes(args, served_model_name=served_model_names(args)[0])


def chat_options(args: argparse.Namespace):
    """The chat route's tool and reasoning settings from the flags."""
    from paged_runtime.entrypoints.openai.serving_chat import ChatOptions
    return ChatOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)


def served_model_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is None:
        from paged_runtime.models.default_model import DEFAULT_MODEL_NAME
        return [DEFAULT_MODEL_NAME]
    return [args.model]


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        chat_options(args)  # a parser flag that cannot work fails before the model loads
        engine = make_engine(config, args)
    except (ValueError, RuntimeError) as e:
        print(f"paged-runtime serve: error: {e}", file=sys.stderr)
        return 2
    try:
        serve_http(engine, args)
    finally:
        engine.shutdown()
    return 0


def make_engine(config, args: argparse.Namespace):
    from paged_runtime.engine.async_engine import AsyncEngine
    from paged_runtime.metrics import LoggingStatLogger, PrometheusStatLogger
    stat_loggers = [PrometheusStatLogger(config.served_model_name)]
    if not args.disable_log_stats:
        stat_loggers.append(LoggingStatLogger(args.log_stats_interval))
    return AsyncEngine.from_config(config, max_waiting_requests=args.max_waiting_requests, stat_loggers=stat_loggers)


def serve_http(engine, args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT, then drain (``entrypoints/openai/drain.py``): new requests get 503, those
    in flight get ``--shutdown-timeout`` seconds, the engine fails the rest with proper error responses."""
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from paged_runtime.entrypoints.openai import build_app
    from paged_runtime.entrypoints.openai.drain import Drain, GracefulShutdown
    key = api_key(args)
    names = served_model_names(args)
    drain = Drain()
    app = build_app(engine, names, api_key=key, model_root=engine.model_root, drain=drain,
                    chat_options=chat_options(args),
                    allowed_origins=args.allowed_origins, max_request_body_bytes=args.max_request_body_bytes,
                    max_prompts_per_request=args.max_prompts_per_request,
                    metrics_require_api_key=args.metrics_require_api_key, chat_template=args.chat_template)
    logger.info("serving %s on http://%s:%d/v1 (max_model_len %d%s)", ", ".join(names), args.host, args.port,
                engine.max_model_len, ", API key required" if key else "")
    # Every admitted request has its response by the time uvicorn stops: its own grace is a backstop only.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.uvicorn_log_level or args.log_level,
                                           timeout_keep_alive=5, timeout_graceful_shutdown=5))
    GracefulShutdown(drain, args.shutdown_timeout, engine.shutdown,
                     on_drained=lambda sig: setattr(server, "should_exit", True)).install(server)
    server.run()
    if not server.started:  # e.g. the port is taken (uvicorn logged why): fail as uvicorn.run does
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
