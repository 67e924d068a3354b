"""The model registry: one ``ModelFamily`` per config.json architecture, registered once, next to its class.

A family file calls ``register(...)`` at import; ``FAMILY_MODULES`` is the one list of those files. The
first lookup imports them all (which imports torch: the classes and hooks live there); importing this
module does not, so ``models/config.py`` and ``models/gguf_convert.py`` stay torch-free until they look a
family up.

Invariants: an architecture name is registered once; ``families()`` lists them in ``FAMILY_MODULES``
order, then in the order each file registers them (the order error messages list them in), whatever
imported the files first.
"""
from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from paged_runtime.models.gguf_spec import GgufSpec

if TYPE_CHECKING:
    from paged_runtime.models.config import ModelConfig

# Adding a family: a file in models/ that calls register(...), and its name here.
FAMILY_MODULES = ("llama", "qwen3", "gemma3", "mixtral", "qwen3_moe", "olmoe", "phi3", "bert")

# The fields read generically from config.json -> the family's reading (ModelConfig.from_dict).
ConfigHook = Callable[["ModelConfig"], "ModelConfig"]


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # config.json "architectures"[0]
    model_class: type  # what load_model builds: (config, max_len, dtype, device, ops, tp, stage, method=)
    config_hook: ConfigHook | None = None  # None: the generic reading is the family's
    # Why its pre-quantized (GPTQ, AWQ, compressed-tensors) checkpoints are refused; None: they load.
    not_prequantized: str | None = None
    gguf: GgufSpec | None = None  # None: no GGUF file converts to it
    module: str = ""  # the file that registered it (orders the registry; see _table)
    # An encoder-only family (BERT): bidirectional attention over each whole prompt and no KV cache, so it only
    # pools (pooling_params.resolve_runner) and the engine runs each prompt whole in one step, with no prefix
    # cache (engine/core.py) and the encoder attention backend (attention/encoder_backend.py).
    encoder_only: bool = False
    pooling_type: str = "LAST"  # its pooling without --pooling-type or a sentence-transformers config (vLLM's)


# Filled by the family files' imports (append-only); read through _table(), which imports them all first.
_REGISTERED: dict[str, ModelFamily] = {}


def register(architecture: str, model_class: type, *, config_hook: ConfigHook | None = None,
             not_prequantized: str | None = None, gguf: GgufSpec | None = None, encoder_only: bool = False,
             pooling_type: str = "LAST") -> ModelFamily:
    """Record the family serving ``architecture``; ValueError if another already does. Called at the top
    level of a family file (the caller's module is recorded, as ``collections.namedtuple`` records it)."""
    if architecture in _REGISTERED:
        raise ValueError(f"architecture {architecture!r} is registered twice")
    module = sys._getframe(1).f_globals["__name__"]
    family = ModelFamily(architecture, model_class, config_hook, not_prequantized, gguf, module, encoder_only,
                         pooling_type)
    _REGISTERED[architecture] = family
    return family


@functools.cache
def _table() -> dict[str, ModelFamily]:
    for name in FAMILY_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    rank = {f"{__package__}.{name}": i for i, name in enumerate(FAMILY_MODULES)}
    stray = [f"{f.architecture} ({f.module})" for f in _REGISTERED.values() if f.module not in rank]
    if stray:
        raise RuntimeError(f"registered from a module FAMILY_MODULES does not list: {', '.join(stray)}")
    # A stable sort: within one module, the order its register calls ran in. Sorting (not import order)
    # because a caller may import a family file, and the files it imports, before the first lookup.
    ordered = sorted(_REGISTERED.values(), key=lambda f: rank[f.module])
    _check_gguf_variants(ordered)
    return {f.architecture: f for f in ordered}


def _check_gguf_variants(ordered: list[ModelFamily]) -> None:
    """GgufSpec's invariant: a llama.cpp name has at most one family with experts and one without."""
    seen = set()
    for f in ordered:
        for name in f.gguf.architectures if f.gguf else ():
            variant = (name, bool(f.gguf.experts))
            if variant in seen:
                raise RuntimeError(f"two families convert from GGUF {name!r} {'with' if variant[1] else 'without'} "
                                   f"experts ({f.architecture} is the second)")
            seen.add(variant)


def families() -> tuple[ModelFamily, ...]:
    return tuple(_table().values())


def architectures() -> tuple[str, ...]:
    """Every config.json architecture served, in registry order."""
    return tuple(_table())


def family(architecture: str) -> ModelFamily:
    """The family serving ``architecture``; ValueError naming every supported one otherwise."""
    table = _table()
    if architecture not in table:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(table)}")
    return table[architecture]


def gguf_families(gguf_architecture: str) -> tuple[ModelFamily, ...]:
    """The families converting from llama.cpp's ``general.architecture`` name (none: unsupported)."""
    return tuple(f for f in families() if f.gguf and gguf_architecture in f.gguf.architectures)


def gguf_architectures() -> tuple[str, ...]:
    """Every llama.cpp architecture name some family converts from, sorted."""
    return tuple(sorted({name for f in families() if f.gguf for name in f.gguf.architectures}))
