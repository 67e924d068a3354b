"""AWQ checkpoints (``quant_method: awq``, AutoAWQ's GEMM version): 4-bit, groups of 128, served by int4.

Layout: ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [K / 128, N / 8], eight codes per word along N in
AWQ's interleaved order (word nibble i holds column ``ORDER[i]`` of its eight), ``scales`` [K / 128, N];
w = (q - z) * s.
"""
from __future__ import annotations

import torch

from paged_runtime.layers.quantization.prequantized import CheckpointInt4Method, unpack_nibbles, transposed

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing: nibble i <- column ORDER[i]
COLUMN_NIBBLE = torch.tensor([ORDER.index(c) for c in range(8)])  # column c <- nibble COLUMN_NIBBLE[c]


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """uint8 codes [a, 8b] of AWQ words [a, b], columns in their true order."""
    nibbles = unpack_nibbles(words, 1).view(words.shape[0], -1, 8)
    return nibbles[:, :, COLUMN_NIBBLE.to(words.device)].reshape(words.shape[0], -1)


class AWQLinearMethod(CheckpointInt4Method):
    codes, scales, zeros = "qweight", "scales", "qzeros"
    format_name = "AWQ"

    def converter(self, name: str):
        if name in ("qweight", "qzeros"):
            return transposed(unpack_awq)
        return transposed(lambda t: t.float())


def awq_method(config: dict) -> AWQLinearMethod:
    """The method for a checkpoint's ``quantization_config`` (ValueError naming what is not supported)."""
    bits, group = config.get("bits", config.get("w_bit")), config.get("group_size", config.get("q_group_size"))
    version, zero_point = str(config.get("version", "gemm")).lower(), config.get("zero_point", True)
    if bits != 4 or group != 128 or version != "gemm" or not zero_point:
        raise ValueError(f"AWQ checkpoint with bits={bits}, group_size={group}, version={version}, "
                         f"zero_point={zero_point} is not supported; supported: bits=4, group_size=128, "
                         "version=gemm, zero_point=true")
    if config.get("modules_to_not_convert"):
        raise ValueError(f"AWQ checkpoint with modules_to_not_convert={config['modules_to_not_convert']} is not "
                         "supported; supported: every decoder linear layer quantized alike")
    return AWQLinearMethod()
