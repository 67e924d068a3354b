"""GPTQ checkpoints (``quant_method: gptq``): 4-bit, groups of 128 input features, served by the int4 method.

Layout (AutoGPTQ / GPTQModel, checkpoint_format "gptq"): ``qweight`` int32 [K / 8, N] (eight codes per word
along K, code i in bits 4i..4i+3), ``qzeros`` int32 [K / 128, N / 8] (packed likewise along N), ``scales``
[K / 128, N], ``g_idx`` [K]; w = (q - z) * s. Format "gptq" (v1) stores each zero minus one (z = stored + 1,
as AutoGPTQ reads it), "gptq_v2" stores z itself; a symmetric checkpoint stores z = 8 like any other.

``desc_act`` (act-order: input features quantized in a permuted order, ``g_idx`` not ``i // 128``) is refused;
without it ``g_idx`` is ``i // 128`` by construction and is not read.
"""
from __future__ import annotations

from paged_runtime.layers.quantization.prequantized import CheckpointInt4Method, unpack_nibbles, transposed


class GPTQLinearMethod(CheckpointInt4Method):
    codes, scales, zeros = "qweight", "scales", "qzeros"
    format_name = "GPTQ"

    def __init__(self, zero_offset: int = 1, cpu_kernels: bool = True) -> None:
        super().__init__(cpu_kernels)
        self.zero_offset = zero_offset

    def converter(self, name: str):
        if name == "qweight":
            return transposed(lambda t: unpack_nibbles(t, 0))
        if name == "qzeros":
            return transposed(lambda t: unpack_nibbles(t, 1) + self.zero_offset)
        return transposed(lambda t: t.float())


def gptq_method(config: dict) -> GPTQLinearMethod:
    """The method for a checkpoint's ``quantization_config`` (ValueError naming what is not supported)."""
    bits, group, desc_act = config.get("bits"), config.get("group_size"), config.get("desc_act", False)
    if bits != 4 or group != 128:
        raise ValueError(f"GPTQ checkpoint with bits={bits}, group_size={group} is not supported; supported: "
                         "bits=4, group_size=128")
    if desc_act:
        raise ValueError("GPTQ checkpoint with desc_act=true (act-order) is not supported; supported: "
                         "desc_act=false")
    if config.get("modules_to_not_convert") or config.get("dynamic"):
        raise ValueError("GPTQ checkpoint with per-module exceptions (modules_to_not_convert / dynamic) is not "
                         "supported; supported: every decoder linear layer quantized alike")
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; supported: gptq, gptq_v2")
    return GPTQLinearMethod(zero_offset=1 if checkpoint_format == "gptq" else 0)
