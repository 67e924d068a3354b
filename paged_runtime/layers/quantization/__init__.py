"""Quantized weights: a ``LinearMethod`` per format. ``int8`` / ``int4`` quantize at load; ``gguf`` serves a
GGUF file's own blocks (``gguf.py``; the checkpoint decides it, see ``models/loader``).

Quantizing at load (``--quantization int8 | int4``):

Each method registers a full-precision ``weight`` like the unquantized one, so the layers' sharded
``weight_loader``s place checkpoint tensors unchanged (tensor parallelism included: each rank quantizes its
own shard). ``process_weights_after_loading`` quantizes that weight, registers the packed tensors and scales
as buffers and deletes the full-precision parameter (its memory is freed: the loader keeps quantized models
out of the shared huge-page buffer). ``apply`` multiplies by the quantized weight: with torch's weight-only
CPU kernels where they serve (bfloat16 activations), elsewhere (CUDA, float32, odd shapes) by dequantizing to
the activations' dtype and ``F.linear``.

Every format keeps a plain-torch ``quantize_*`` / ``dequantize_*`` pair: the definition of the format and
the oracle the kernels are tested against.
"""
from __future__ import annotations

import torch

from paged_runtime.layers.linear import LinearMethod, UnquantizedLinearMethod
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.quantization.gguf import GGUFLinearMethod
from paged_runtime.layers.quantization.int4 import Int4LinearMethod
from paged_runtime.layers.quantization.int8 import Int8LinearMethod

METHODS = {"int8": Int8LinearMethod, "int4": Int4LinearMethod, "gguf": GGUFLinearMethod}
# What ``EngineConfig.quantization`` accepts besides None (config.QUANTIZATIONS repeats it without imports).
NAMES = ("none", *METHODS)
# Formats a checkpoint brings (the others quantize at load).
CHECKPOINT_FORMATS = ("gguf",)


def is_quantized(name: str | None) -> bool:
    return name not in (None, "none")


def linear_method(name: str | None, ops: TorchOps, kernels=None) -> LinearMethod:
    """The method for ``--quantization name`` (None or "none": plain weights multiplied by ``ops``);
    ``kernels``: the compiled CPU kernels module where it loaded (the GGUF method multiplies with it)."""
    if not is_quantized(name):
        return UnquantizedLinearMethod(ops)
    if name not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(NAMES)}; got {name!r}")
    return GGUFLinearMethod(kernels) if name == "gguf" else METHODS[name]()


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a tied weight counted once; the tensors' own bytes, not
    the buffer they may share, e.g. the unquantized CPU model's one huge-page buffer)."""
    tensors = {(t.data_ptr(), t.nbytes): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.nbytes for t in tensors.values())
