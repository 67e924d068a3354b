"""How a pooling request (``--runner pooling``: embeddings) turns its prompt's hidden states into one vector.

Torch-free. A pooling request is prefill only: it is scheduled like any prompt (chunked prefill, the prefix
cache), never samples, and finishes when its last prompt token is computed. The model runner pools the final
hidden states (after the model's final norm, as vLLM's poolers read them):

- ``LAST``: the last prompt token's row (vLLM's default for decoder models);
- ``MEAN``: the mean of every prompt token's row, summed chunk by chunk in float32.

then keeps the first ``dimensions`` entries (Matryoshka) and, with ``normalize``, divides by the L2 norm.

Prefix caching rule: a MEAN request needs the hidden state of every prompt token, and a prefix-cache hit
skips computing them, so MEAN requests never start from cached blocks (``Request.skip_prefix_cache``; their
own blocks are still published). LAST requests use the cache: a hit is capped so the last prompt token is
always computed, and its row is the only one they read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("LAST", "MEAN")
RUNNERS = ("auto", "generate", "pooling")
# vLLM's older --task values, read as a runner
_TASK_RUNNERS = {"embed": "pooling", "embedding": "pooling", "pooling": "pooling", "generate": "generate",
                 "auto": "auto"}


def parse_runner(text: str) -> str:
    """``--runner`` / ``--task`` text to a runner name (vLLM's ``--task embed`` is ``pooling``)."""
    return _TASK_RUNNERS.get(text.strip().lower(), text)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """One pooling request's pooler: its type, its Matryoshka truncation and whether it is normalised."""
    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None  # keep the first ``dimensions`` entries (None: all)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be positive, got {self.dimensions}")


def check_runner(is_pooling: bool, pooling: PoolingParams | None) -> None:
    """ValueError unless a request is what its engine runs: a pooling engine takes only pooling requests
    (``pooling`` set), a generating one none."""
    if (pooling is not None) != is_pooling:
        raise ValueError("this model runs as a pooling model (--runner pooling): it embeds, it does not generate"
                         if is_pooling else "this model runs as a generative model: start it with --runner pooling "
                         "to embed")


def folder_pooling_type(folder: str | Path) -> str | None:
    """The pooling a sentence-transformers folder declares (``modules.json`` naming a Pooling module, whose
    ``config.json`` sets ``pooling_mode_lasttoken`` or ``pooling_mode_mean_tokens``); None when it declares none
    this runtime runs (or the folder is no sentence-transformers model)."""
    folder = Path(folder)
    modules = folder / "modules.json"
    if not modules.is_file():
        return None
    try:
        entries = json.loads(modules.read_text())
        pooling = next((m for m in entries if str(m.get("type", "")).endswith("Pooling")), None)
        if pooling is None:
            return None
        config = json.loads((folder / pooling.get("path", "1_Pooling") / "config.json").read_text())
    except (OSError, ValueError, AttributeError):
        return None
    if config.get("pooling_mode_lasttoken"):
        return "LAST"
    if config.get("pooling_mode_mean_tokens"):
        return "MEAN"
    return None


def request_pooling(pooling_type: str, hidden_size: int, default_normalize: bool, dimensions: int | None = None,
                    normalize: bool | None = None) -> PoolingParams:
    """One request's pooler on an engine pooling by ``pooling_type`` with vectors of ``hidden_size``;
    ``ParameterError`` naming ``dimensions`` when it is not in [1, hidden_size]."""
    from paged_runtime.sampling_params import INVALID_VALUE, ParameterError
    if dimensions is not None and not (isinstance(dimensions, int) and 1 <= dimensions <= hidden_size):
        raise ParameterError(f"dimensions must be in [1, {hidden_size}] (the model's hidden size), got {dimensions}",
                             "dimensions", INVALID_VALUE)
    return PoolingParams(pooling_type, default_normalize if normalize is None else normalize, dimensions)
