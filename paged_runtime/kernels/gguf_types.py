"""The GGUF block-quantized weight types the kernels multiply by (``cpu_ops.c``, GGUF section; ``quant_gemm.py``).

Pure Python, no imports from the rest of the package: the kernels, the loader and the linear method all
read the type table from here. Ids and block shapes are llama.cpp's (``ggml_type`` and
``GGML_QUANT_SIZES`` in the ``gguf`` package); a row of K inputs is K / block_elems blocks of
block_bytes each, exactly the bytes of that row in a GGUF file.
"""
from __future__ import annotations

from typing import NamedTuple


class GgufType(NamedTuple):
    id: int  # the ggml_type / GGMLQuantizationType value, also the C kernels' qtype argument
    name: str
    block_elems: int  # weights per block
    block_bytes: int  # bytes per block


GGUF_TYPES: dict[str, GgufType] = {t.name: t for t in (
    GgufType(2, "Q4_0", 32, 18),
    GgufType(3, "Q4_1", 32, 20),
    GgufType(6, "Q5_0", 32, 22),
    GgufType(7, "Q5_1", 32, 24),
    GgufType(8, "Q8_0", 32, 34),
    GgufType(12, "Q4_K", 256, 144),
    GgufType(13, "Q5_K", 256, 176),
    GgufType(14, "Q6_K", 256, 210),
)}


def supported_names() -> tuple[str, ...]:
    return tuple(GGUF_TYPES)


def gguf_type(name_or_id: str | int) -> GgufType:
    """The type named ``"Q4_1"`` (any case) or with ggml id 3; a ValueError listing the supported ones."""
    for t in GGUF_TYPES.values():
        if name_or_id == t.id or (isinstance(name_or_id, str) and name_or_id.upper() == t.name):
            return t
    raise ValueError(f"unsupported GGUF quantization type {name_or_id!r}; supported: "
                     + ", ".join(f"{t.name} ({t.id})" for t in GGUF_TYPES.values()))


def row_bytes(qtype: str | int | GgufType, k: int) -> int:
    """Bytes of one row of ``k`` weights; a ValueError unless ``k`` is a whole number of blocks."""
    t = qtype if isinstance(qtype, GgufType) else gguf_type(qtype)
    if k <= 0 or k % t.block_elems:
        raise ValueError(f"{t.name} rows hold a multiple of {t.block_elems} weights, not {k}")
    return k // t.block_elems * t.block_bytes
