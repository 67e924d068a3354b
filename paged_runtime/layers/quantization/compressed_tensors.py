"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, llm-compressor's output).

Supported schemes (one config group targeting every ``Linear``; ``ignore`` may name only the LM head and
embeddings, which are never quantized here):

- W8A16 (8-bit int, symmetric, per channel): ``int-quantized`` / ``naive-quantized`` ``weight`` int8 [N, K],
  or ``pack-quantized`` ``weight_packed`` int32 [N, K / 4] (value q + 128 in bits 8i.. of word i // 4, what
  the library writes by default); ``weight_scale`` [N, 1]. Served by the int8 method.
- W4A16 (``pack-quantized``, 4-bit int, groups of 128, symmetric or asymmetric): ``weight_packed`` int32
  [N, K / 8] (value q + 8 in bits 4i.. of word i // 8), ``weight_scale`` [N, K / 128], ``weight_zero_point``
  int32 [N / 8, K / 128] (asymmetric only; zp + 8 packed likewise along N), ``weight_shape``; w = (q - zp) * s.
  Served by the int4 method.
- FP8 (``float-quantized`` / ``naive-quantized``, float8_e4m3fn weights per tensor or per channel; activations
  dynamic per token, static per tensor with ``input_scale``, or none (weight-only)); served by the fp8 method.
"""
from __future__ import annotations

from paged_runtime.layers.linear import LinearMethod
from paged_runtime.layers.quantization.fp8 import Fp8CheckpointMethod
from paged_runtime.layers.quantization.prequantized import (CheckpointInt4Method, CheckpointInt8Method,
                                                             unpack_nibbles)

SUPPORTED = ("W8A16 (int-quantized or pack-quantized, int8 per channel, symmetric)",
             "W4A16 (pack-quantized, int4 group 128, symmetric or asymmetric)",
             "FP8 (float-quantized, float8 weights per tensor or channel; activations dynamic per token, "
             "static per tensor, or none)")
UNQUANTIZED = ("lm_head", "embed_tokens")  # never quantized here: ``ignore`` may name them (plainly or by regex)


class CompressedInt4Method(CheckpointInt4Method):
    codes, scales = "weight_packed", "weight_scale"
    format_name = "compressed-tensors W4A16"

    def __init__(self, symmetric: bool, cpu_kernels: bool = True) -> None:
        super().__init__(cpu_kernels)
        self.zeros = "" if symmetric else "weight_zero_point"

    def converter(self, name: str):
        if name == "weight_packed":
            return lambda tensor, rows: unpack_nibbles(tensor, 1)
        if name == "weight_zero_point":
            return lambda tensor, rows: unpack_nibbles(tensor, 0)[:rows]
        return lambda tensor, rows: tensor.float()


def compressed_tensors_method(config: dict) -> LinearMethod:
    """The method for a checkpoint's ``quantization_config`` (ValueError naming what is not supported)."""
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if config.get(key):
            raise ValueError(f"compressed-tensors checkpoint with {key} is not supported; supported schemes: "
                             + "; ".join(SUPPORTED))
    ignored = [name for name in config.get("ignore") or [] if not any(part in name for part in UNQUANTIZED)]
    if ignored:
        raise ValueError(f"compressed-tensors checkpoint ignores {ignored[:3]}: per-module exceptions are not "
                         "supported; supported: every decoder linear layer quantized alike (ignore: lm_head)")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
        raise ValueError(f"compressed-tensors checkpoint with {len(groups)} config groups targeting "
                         f"{[g.get('targets') for g in groups]} is not supported; supported: one group "
                         "targeting ['Linear']")
    group = groups[0]
    fmt = group.get("format") or config.get("format")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    scheme = (f"format={fmt}, weights {kind} {bits}-bit {strategy} group_size={weights.get('group_size')} "
              f"symmetric={weights.get('symmetric')}, input_activations={_describe(inputs)}")
    plain = not weights.get("dynamic") and not weights.get("actorder")  # static weights in natural order
    if plain and kind == "int" and inputs is None:
        if (bits == 8 and strategy == "channel" and weights.get("symmetric")
                and fmt in ("int-quantized", "naive-quantized", "pack-quantized")):
            return CheckpointInt8Method(packed=fmt == "pack-quantized")
        if bits == 4 and strategy == "group" and weights.get("group_size") == 128 and fmt == "pack-quantized":
            return CompressedInt4Method(symmetric=bool(weights.get("symmetric")))
    elif (plain and kind == "float" and bits == 8 and strategy in ("tensor", "channel") and weights.get("symmetric")
          and fmt in ("float-quantized", "naive-quantized")):
        if inputs is None:
            return Fp8CheckpointMethod(static_input=False, activations=False)
        if inputs.get("type") == "float" and inputs.get("num_bits") == 8:
            if inputs.get("dynamic") and inputs.get("strategy") == "token":
                return Fp8CheckpointMethod(static_input=False)
            if not inputs.get("dynamic") and inputs.get("strategy") == "tensor":
                return Fp8CheckpointMethod(static_input=True)
    raise ValueError(f"compressed-tensors scheme ({scheme}) is not supported; supported: " + "; ".join(SUPPORTED))


def _describe(inputs: dict | None) -> str:
    if inputs is None:
        return "none"
    dynamic = "dynamic" if inputs.get("dynamic") else "static"
    return f"{inputs.get('type')} {inputs.get('num_bits')}-bit {dynamic} {inputs.get('strategy')}"
