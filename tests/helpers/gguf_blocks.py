"""Random but valid GGUF block rows for tests: random quants, the fp16 scale fields set so weights are about
+-0.3 (what the block-format tests of the CPU path and of the Triton kernels read)."""
from __future__ import annotations

import numpy as np

from paged_runtime.kernels.gguf_types import row_bytes
from paged_runtime.layers.quantization.gguf_blocks import SERVED

# Per type: the f16 fields (byte offset, value) that scale a block to weights of about +-0.3.
_SCALES = {"Q4_0": [(0, 0.3 / 8)], "Q4_1": [(0, 0.6 / 15), (2, -0.3)], "Q8_0": [(0, 0.3 / 127)],
           "Q5_0": [(0, 0.3 / 16)], "Q5_1": [(0, 0.6 / 31), (2, -0.3)],
           "Q4_K": [(0, 0.6 / (63 * 15)), (2, 0.3 / 63)], "Q5_K": [(0, 0.6 / (63 * 31)), (2, 0.3 / 63)],
           "Q6_K": [(208, 0.3 / (127 * 32))]}


def random_blocks(rows: int, k: int, name: str, rng) -> np.ndarray:
    qtype = SERVED[name]
    raw = rng.integers(0, 256, size=(rows, row_bytes(qtype, k)), dtype=np.uint8)
    blocks = raw.reshape(-1, qtype.block_bytes)
    for offset, value in _SCALES[name]:
        blocks[:, offset:offset + 2] = np.full((len(blocks), 1), value, np.float16).view(np.uint8)
    return raw
