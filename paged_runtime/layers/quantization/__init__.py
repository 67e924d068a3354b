"""Quantized weights: a ``LinearMethod`` per format. Quantized at load: ``--quantization int8 | int4 | fp8``;
a checkpoint's own format: a GGUF file's blocks (``gguf.py``), pre-quantized Hugging Face checkpoints (GPTQ, AWQ,
compressed-tensors: ``CHECKPOINT_FORMATS``, read from their ``config.json``'s ``quantization_config``,
``checkpoint_quantization``). ``models/loader`` decides which.

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
from paged_runtime.layers.quantization.awq import awq_method
from paged_runtime.layers.quantization.compressed_tensors import compressed_tensors_method
from paged_runtime.layers.quantization.fp8 import Fp8LinearMethod
from paged_runtime.layers.quantization.gguf import GGUFLinearMethod
from paged_runtime.layers.quantization.gptq import gptq_method
from paged_runtime.layers.quantization.int4 import Int4LinearMethod
from paged_runtime.layers.quantization.int8 import Int8LinearMethod

# Quantized at load (fp8's method also serves compressed-tensors FP8 checkpoints)
METHODS = {"int8": Int8LinearMethod, "int4": Int4LinearMethod, "fp8": Fp8LinearMethod}
# Pre-quantized checkpoints: quant_method -> (its quantization_config -> the method; ValueError if unsupported)
CHECKPOINT_FORMATS = {"gptq": gptq_method, "awq": awq_method, "compressed-tensors": compressed_tensors_method}
# The names these methods serve: exactly the setting's choices (config.QUANTIZATIONS, tested equal); "gguf" is a
# converted .gguf's blocks (models/gguf_convert.py writes them beside the dequantized weights).
NAMES = ("none", *METHODS, "gguf", *CHECKPOINT_FORMATS)


def is_quantized(name: str | None) -> bool:
    return name not in (None, "none")


def checkpoint_quantization(config_json: dict) -> str | None:
    """The pre-quantized format of a checkpoint by its ``config.json`` (None: plain weights); a format not
    served here is refused, named, with the supported ones."""
    config = config_json.get("quantization_config")
    if not config:
        return None
    name = config.get("quant_method")
    if name not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint quantization {name!r} (config.json quantization_config.quant_method) is not "
                         f"supported; supported: {', '.join(CHECKPOINT_FORMATS)}")
    return name


def linear_method(name: str | None, ops: TorchOps, quantization_config: dict | None = None,
                  kernels=None) -> LinearMethod:
    """The method for ``--quantization name`` (None or "none": plain weights multiplied by ``ops``); a
    pre-quantized checkpoint's format is built from its ``quantization_config``; ``kernels``: the compiled CPU
    kernels module where it loaded (the GGUF method multiplies with it)."""
    if not is_quantized(name):
        return UnquantizedLinearMethod(ops)
    if name in CHECKPOINT_FORMATS:
        if quantization_config is None:
            raise ValueError(f"quantization {name!r} is a checkpoint format: the checkpoint's config.json must "
                             "have a quantization_config with that quant_method")
        return CHECKPOINT_FORMATS[name](quantization_config)
    if name == "gguf":
        return GGUFLinearMethod(kernels)
    if name not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(NAMES)}; got {name!r}")
    return METHODS[name]()


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a tied weight counted once; the tensors' own bytes, not
    the buffer they may share, e.g. the unquantized CPU model's one huge-page buffer)."""
    tensors = {(t.data_ptr(), t.nbytes): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.nbytes for t in tensors.values())
