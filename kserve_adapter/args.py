"""The adapter's command line: KServe's model-server flags plus the runtime's own, in one parser.

KServe's flags (``--model_name``, ``--http_port``, ``--workers``, ...) come
from ``kserve.model_server.parser`` as a parent, so their names, defaults and
help are KServe's. The runtime's flags are generated from the same settings as
``paged-runtime serve``'s (``paged_runtime/config.py``), with the same names
(``--max-model-len``, ``--served-model-name``, ...). Abbreviations are off:
with them ``--model`` would be taken as a prefix of ``--model_name`` or
``--model_dir`` whenever it is not spelled out exactly, and a typo would
silently set some other flag.

Which model is served: ``--model PATH`` if given; else ``--model_dir`` (KServe
passes ``/mnt/models``, where its storage initializer puts ``storageUri``) if
it holds a model; else the embedded default. A ``--model_dir`` with no model
in it means the InferenceService gave no ``storageUri``. Several models
(``--model A --model B``, ``--models-dir DIR``) are each a KServe model named
by folder or file stem (``--model_name`` then names none of them).

huggingfaceserver's arguments are accepted too, so an InferenceService
written for it runs here unchanged: ``--model_id`` (a local folder: weights
are never downloaded), ``--max_model_len`` / ``--max_length``,
``--tensor_parallel_size``, ``--dtype`` and ``--task text_generation`` mean
what they mean there (the second and third are the settings' own
huggingfaceserver spellings, in ``paged_runtime/config.py``); the ones this
runtime has no use for (``HF_UNUSED``: ``--backend``, ``--trust_remote_code``,
``--disable_lower_case``, ``--return_probabilities``, ...) are logged in
one warning that names them, never an error. A task other than text
generation is an error: this runtime cannot serve it.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kserve.model_server import parser as kserve_parser

from paged_runtime.config import EngineConfig, ServerConfig
from paged_runtime.settings import add_arguments

logger = logging.getLogger("kserve_adapter")

# huggingfaceserver's flags that change nothing here: flag -> its default (a value other than it is warned about).
# (Those with a meaning here, --max_model_len / --max_length, --tensor_parallel_size, --disable_log_requests, are
# the settings' huggingfaceserver spellings: config.py.)
HF_UNUSED = {"--model_revision": None, "--tokenizer_revision": None, "--trust_remote_code": False,
             "--tensor_input_names": None, "--backend": "auto", "--return_token_type_ids": False,
             "--return_probabilities": False, "--return_raw_logits": False, "--disable_lower_case": False,
             "--disable_special_tokens": False, "--max_log_len": None}
_HF_FLAGS = {"--tensor_input_names", "--model_revision", "--tokenizer_revision", "--backend", "--max_log_len"}
GENERATION_TASKS = ("text_generation",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kserve_adapter", parents=[kserve_parser], allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve a paged-runtime model as a KServe model server (v1, v2 and OpenAI routes).")
    model = parser.add_argument_group("model")
    model.add_argument("--model_dir", default=None, metavar="DIR",
                       help="where KServe put the model (/mnt/models); with no model in it, the embedded default; "
                            "--model wins over it")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0",
                        help="address to bind (KServe's own server always binds 0.0.0.0; 127.0.0.1 for local runs)")
    add_arguments(parser, (ServerConfig, EngineConfig), "kserve", groups={"server": server})
    add_huggingfaceserver_arguments(parser)
    # One HTTP port per pod (the ClusterServingRuntime declares 8080 only); gRPC v2 is opt-in.
    parser.set_defaults(enable_grpc=False)
    return parser


def add_huggingfaceserver_arguments(parser: argparse.ArgumentParser) -> None:
    """huggingfaceserver's flags the settings do not spell (see the module docstring)."""
    hf = parser.add_argument_group("huggingfaceserver compatibility")
    hf.add_argument("--model_id", default=None, metavar="PATH", help="as --model (a local folder; never downloaded)")
    hf.add_argument("--task", default=None, help="only text_generation is served")
    for flag, default in HF_UNUSED.items():
        dest = flag.lstrip("-")
        if flag == "--max_log_len":
            hf.add_argument(flag, "--max-log-len", dest=dest, type=int, default=None, help="ignored here")
        elif flag in _HF_FLAGS:
            hf.add_argument(flag, dest=dest, default=default, help="ignored here")
        else:
            hf.add_argument(flag, dest=dest, action="store_true", help="ignored here")


def warn_unused(args: argparse.Namespace) -> list[str]:
    """Log one warning naming the huggingfaceserver flags that were set but mean nothing here; returns them."""
    unused = [flag for flag, default in HF_UNUSED.items()
              if (value := getattr(args, flag.lstrip("-"))) is not None and value != default]
    if unused:
        logger.warning("ignoring huggingfaceserver arguments this runtime does not use: %s", ", ".join(unused))
    return unused


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed flags with ``model`` resolved (a path or None; the list of paths for several models) and, for one
    model, ``served_model_name`` defaulting to the KServe model name. Exits with status 2 and a message for a flag the adapter cannot honour."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers != 1:
        parser.error(f"--workers must be 1, got {args.workers}: each worker would load its own copy of the "
                     "model and KV cache; scale with replicas (minReplicas/maxReplicas) instead")
    if args.task is not None and args.task not in GENERATION_TASKS:
        parser.error(f"--task {args.task!r} is not served: this runtime does text generation only")
    paths = list(getattr(args, "model", None) or [])
    if not paths and args.model_id is not None:
        if not Path(args.model_id).expanduser().exists():
            parser.error(f"--model_id {args.model_id!r} is not a local folder: weights are never downloaded "
                         "(give the InferenceService a storageUri, mounted at --model_dir)")
        paths = [args.model_id]
    for path in paths:
        if not Path(path).expanduser().exists():
            parser.error(f"--model {path!r} does not exist (weights are never downloaded)")
    warn_unused(args)
    if len(paths) > 1 or getattr(args, "models_dir", None) is not None:
        args.model = paths  # several models: each is a KServe model under its own name (server.build_models)
        return args
    args.model = resolve_model(paths[0] if paths else None, args.model_dir)
    args.served_model_name = getattr(args, "served_model_name", None) or [args.model_name]
    return args


def resolve_model(model: str | None, model_dir: str | None) -> str | None:
    """The path to load: ``model``; else what ``model_dir`` holds; None (the embedded default) if nothing."""
    if model is not None or model_dir is None:
        return model
    folder = Path(model_dir)
    if not folder.is_dir() or not any(folder.iterdir()):
        logger.info("no model in %s: serving the embedded default", model_dir)
        return None
    ggufs = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").exists() and len(ggufs) == 1:
        return str(ggufs[0])  # a storageUri that points at one GGUF file
    return str(folder)  # a Hugging Face folder (the loader says what is wrong if it is not one)
