"""How a pooling request (``--runner pooling``: embeddings) turns its prompt's hidden states into one vector.

Torch-free. A pooling request is prefill only: it is scheduled like any prompt (chunked prefill, the prefix
cache; an encoder-only model's prompt runs whole in one step, never cached: ``engine/core.py``), never samples,
and finishes when its last prompt token is computed. The model runner pools the final hidden states (after the
model's final norm, as vLLM's poolers read them):

- ``LAST``: the last prompt token's row (vLLM's default for decoder models);
- ``MEAN``: the mean of every prompt token's row, summed chunk by chunk in float32;
- ``CLS``: the first prompt token's row (BERT's [CLS]; vLLM's default for encoder models),

then keeps the first ``dimensions`` entries (Matryoshka) and, with ``normalize``, divides by the L2 norm.

Prefix caching rule: MEAN and CLS read rows before the last (every row, or the first), and a prefix-cache hit
skips computing them, so those requests never start from cached blocks (``PoolingParams.skips_prefix_cache``,
read by ``Request.skip_prefix_cache``; their own blocks are still published). LAST requests use the cache: a
hit is capped so the last prompt token is always computed, and its row is the only one they read.

Which runner a model runs as (``resolve_runner``): an encoder-only family (``ModelFamily.encoder_only``) can
only pool, so ``auto`` pools it and ``generate`` is refused; any other family generates unless asked to pool.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config flag -> the pooling it declares
_FOLDER_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
RUNNERS = ("auto", "generate", "pooling")
# vLLM's older --task values, read as a runner
_TASK_RUNNERS = {"embed": "pooling", "embedding": "pooling", "pooling": "pooling", "generate": "generate",
                 "auto": "auto"}


def parse_runner(text: str) -> str:
    """``--runner`` / ``--task`` text to a runner name (vLLM's ``--task embed`` is ``pooling``)."""
    return _TASK_RUNNERS.get(text.strip().lower(), text)


def resolve_runner(runner: str, architecture: str, encoder_only: bool) -> str:
    """What a model of ``architecture`` runs as when ``runner`` is asked: an encoder-only model has no LM head and
    attends both ways, so it can only pool (``auto`` is pooling; ``generate`` is a ValueError naming it, as vLLM
    refuses it); any other model runs as asked (``auto`` reads as generate)."""
    if not encoder_only:
        return runner
    if runner == "generate":
        raise ValueError(f"{architecture} is an encoder-only model: it can only pool (embed), not generate; run it "
                         f"with runner pooling (or auto)")
    return "pooling"


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

    @property
    def skips_prefix_cache(self) -> bool:
        """It reads rows before the last (MEAN: all, CLS: the first), which a prefix-cache hit would skip."""
        return self.pooling_type != "LAST"


def check_runner(is_pooling: bool, pooling: PoolingParams | None) -> None:
    """ValueError unless a request is what its engine runs: a pooling engine takes only pooling requests
    (``pooling`` set), a generating one none."""
    if (pooling is not None) != is_pooling:
        raise ValueError("this model runs as a pooling model (--runner pooling): it embeds, it does not generate"
                         if is_pooling else "this model runs as a generative model: start it with --runner pooling "
                         "to embed")


def folder_pooling_type(folder: str | Path) -> str | None:
    """The pooling a sentence-transformers folder declares (``modules.json`` naming a Pooling module, whose
    ``config.json`` sets exactly one of ``pooling_mode_cls_token``, ``pooling_mode_mean_tokens`` and
    ``pooling_mode_lasttoken``); None when it declares none this runtime runs (or several at once, which
    sentence-transformers concatenates), or the folder is no sentence-transformers model."""
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
    declared = [kind for flag, kind in _FOLDER_MODES.items() if config.get(flag)]
    return declared[0] if len(declared) == 1 else None


def folder_max_seq_length(folder: str | Path) -> int | None:
    """The longest input a sentence-transformers folder declares (``sentence_bert_config.json``'s
    ``max_seq_length``: what it was trained on and truncates to); None when it declares none."""
    try:
        value = json.loads((Path(folder) / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def request_pooling(pooling_type: str, hidden_size: int, default_normalize: bool, dimensions: int | None = None,
                    normalize: bool | None = None) -> PoolingParams:
    """One request's pooler on an engine pooling by ``pooling_type`` with vectors of ``hidden_size``;
    ``ParameterError`` naming ``dimensions`` when it is not in [1, hidden_size]."""
    from paged_runtime.sampling_params import INVALID_VALUE, ParameterError
    if dimensions is not None and not (isinstance(dimensions, int) and 1 <= dimensions <= hidden_size):
        raise ParameterError(f"dimensions must be in [1, {hidden_size}] (the model's hidden size), got {dimensions}",
                             "dimensions", INVALID_VALUE)
    return PoolingParams(pooling_type, default_normalize if normalize is None else normalize, dimensions)
