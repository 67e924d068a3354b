"""Default sampling parameters from a model's ``generation_config.json`` (vLLM's ``--generation-config``).

A model's creator may recommend sampling settings there (Qwen3: temperature 0.6, top_p 0.95, top_k 20).
As vLLM does, they become the defaults of every request that does not set the field itself, on the
OpenAI routes and in ``LLM.get_default_sampling_params``; ``max_new_tokens`` becomes ``max_tokens`` (a
default, and on the routes a cap on what a request asks for, as vLLM's ``get_max_tokens``).

Only values that differ from transformers' own ``GenerationConfig`` defaults count (vLLM reads the file
through ``GenerationConfig.to_diff_dict``): a file saying ``top_k: 50`` or ``temperature: 1.0`` states
transformers' default, not a recommendation, and changes nothing.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# generation_config.json key -> (SamplingParams field, transformers' default: a value equal to it is no advice)
_FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
           "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
           "max_new_tokens": ("max_tokens", None)}


def default_sampling(model_path: Path, source: str = "auto") -> dict[str, Any]:
    """SamplingParams field -> default value from the generation config ``source`` names: "auto" (the model
    folder's), "vllm" (none: the runtime's own defaults) or a folder path. A bad value raises ValueError."""
    if source == "vllm":
        return {}
    folder = model_path if source == "auto" else Path(source).expanduser()
    if source != "auto" and not (folder / FILE_NAME).is_file():
        raise ValueError(f"--generation-config {source!r}: no {FILE_NAME} in that folder")
    path = folder / FILE_NAME
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from e
    defaults = {name: config[key] for key, (name, hf_default) in _FIELDS.items()
                if config.get(key) is not None and config[key] != hf_default}
    _check(defaults, path)
    return defaults


def _check(defaults: dict[str, Any], path: Path) -> None:
    from paged_runtime.sampling_params import SamplingParams
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} recommends a sampling value this runtime cannot use: {e}") from e


def log_defaults(defaults: dict[str, Any]) -> None:
    """Say at start-up that the model's file changed the defaults (as vLLM does), and how to undo it."""
    if defaults:
        logger.info("default sampling parameters from the model's %s: %s (start with --generation-config vllm "
                    "to use the runtime's own defaults)", FILE_NAME, defaults)
