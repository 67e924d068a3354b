"""How many KV blocks fit: from an explicit byte budget or the memory left after weights."""
from __future__ import annotations

import torch

from paged_runtime.core.kv_cache_manager import cdiv
from paged_runtime.kernels import kv_quant
from paged_runtime.layers.attention import attention_layers

# On CPU the cache shares RAM with everything else, so take a modest share
# (vLLM's CPU backend defaults to a fixed 4 GiB for the same reason).
_CPU_SHARE, _CPU_CAP = 0.3, 4 * 2**30


def bytes_per_block(models: list[torch.nn.Module], block_size: int, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> int:
    """One block's bytes in every attention layer of ``models`` (a target and its draft share block ids):
    the layers and KV heads this rank holds, not the whole model's; values in ``dtype`` or the 8-bit
    ``kv_cache_dtype``, with int8's per token and head scales (``kernels.kv_quant``)."""
    per_token = sum(layer.num_kv_heads * kv_quant.bytes_per_token_head(kv_cache_dtype, dtype, layer.head_dim)
                    for model in models for layer in attention_layers(model))
    return per_token * block_size


def free_memory(device: torch.device, utilization: float, num_ranks_here: int = 1) -> int:
    """The KV cache's budget on one rank. On the CPU the ranks of a parallel model share one memory (and
    the share below), so each takes its part of it."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Keep (1 - utilization) of the card for activations and everyone else.
        return max(0, int(free - (1 - utilization) * total))
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return min(int(available * _CPU_SHARE), _CPU_CAP) // num_ranks_here


def shared_kv_budget(device: torch.device, num_models: int) -> int:
    """Each engine's KV budget when one process keeps ``num_models`` models loaded (several models, one
    server): on the CPU the single-model default share of free memory, split evenly. A GPU's default budget is
    "what is left of the card" when the engine starts, which the first engine would take whole, so several
    models on one GPU need their bytes given (``--kv-cache-memory``, per model)."""
    if device.type == "cuda":
        raise ValueError("several models on one GPU need --kv-cache-memory: the bytes of each model's KV cache")
    return free_memory(device, 1.0) // num_models


def num_kv_blocks(per_block: int, block_size: int, budget: int, max_model_len: int, max_num_seqs: int,
                  blocks_per_request: int | None = None) -> int:
    """Blocks of ``per_block`` bytes that fit in ``budget``, capped at what ``max_num_seqs`` full-length
    requests can use.
    ``blocks_per_request``: the most blocks one request holds at once (default: max_model_len's; fewer
    where the KV manager releases blocks behind a sliding window).

    Raises ValueError when not even one request of ``max_model_len`` fits,
    naming the largest length that would. A model whose layers keep no KV (``per_block`` 0: an encoder) gets
    that cap whatever the budget: its blocks only count tokens, and every request can always have them.
    """
    if per_block == 0:
        return max_num_seqs * (blocks_per_request or cdiv(max_model_len, block_size))
    num_blocks = budget // per_block
    if blocks_per_request is not None:
        if num_blocks < blocks_per_request:
            raise ValueError(f"the KV cache holds {num_blocks} blocks of {block_size} tokens; one request needs "
                             f"{blocks_per_request} at once. Give the cache more memory "
                             f"(kv_cache_memory / gpu_memory_utilization).")
        return min(num_blocks, max_num_seqs * blocks_per_request)
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"max_model_len {max_model_len} does not fit in the KV cache: {budget} bytes hold "
            f"{num_blocks} blocks of {block_size} tokens, so the largest max_model_len that fits is "
            f"{num_blocks * block_size}. Lower max_model_len or give the cache more memory "
            f"(kv_cache_memory / gpu_memory_utilization).")
    return min(num_blocks, max_num_seqs * cdiv(max_model_len, block_size))
