"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), read and checked
against the model it will run on.

Each ``<module>.lora_A.weight`` [r, in] / ``lora_B.weight`` [out, r] pair is mapped to one of the model's
linear layers by the family's own checkpoint names (``model.checkpoint_module``: ``q_proj`` is part "q" of
``qkv_proj``); a fused checkpoint module (Phi-3's ``qkv_proj``) covers every part of its layer, A shared and B
split by the parts' rows. ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA) is folded into B.
Anything the runtime would compute differently from PEFT is refused with the reason (``LoRAError``):
``modules_to_save``, DoRA, LoRA biases, per-module rank or alpha patterns, embedding or LM-head targets, a
module the model lacks or does not serve LoRA on, shapes that do not fit, a rank over ``max_lora_rank``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged_runtime.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, \
    RowParallelLinear
from paged_runtime.layers.lora import lora_layers
from paged_runtime.lora.request import LoRAError, LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class LoRAAdapter:
    """An adapter's full-size (unsharded) parts: module path -> {part index: (A [r, in], B [out, r] * scale)}."""
    request: LoRARequest
    rank: int
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.parts.values() for a, b in layer.values())


def read_adapter(request: LoRARequest, model, max_rank: int) -> LoRAAdapter:
    """``request``'s folder as ``model``'s layers take it; ``LoRAError`` where it cannot run as PEFT runs it."""
    folder = Path(request.lora_path)
    config = _read_config(folder)
    rank, scale = _rank_and_scale(config, max_rank)
    tensors = _read_weights(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{key}: not a LoRA weight (embedding and LM-head adapters are not supported)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    adapter = LoRAAdapter(request, rank)
    layers = lora_layers(model)
    for module_name, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAError(f"{module_name}: needs both lora_A and lora_B, found {sorted(pair)}")
        _place(adapter, model, layers, module_name, pair["lora_A"], pair["lora_B"] * scale)
    return adapter


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAError(f"{folder} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{folder / CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{folder / CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"peft_type {config.get('peft_type')!r} is not LORA")
    refusals = {"modules_to_save": "modules_to_save (whole trained copies of modules) is not supported",
                "use_dora": "DoRA adapters are not supported", "rank_pattern": "per-module ranks are not supported",
                "alpha_pattern": "per-module alphas are not supported"}
    for name, why in refusals.items():
        if config.get(name):
            raise LoRAError(why)
    if config.get("bias", "none") != "none":
        raise LoRAError(f"bias={config['bias']!r}: LoRA biases are not supported")
    return config


def _rank_and_scale(config: dict, max_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"rank {rank} is over --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)):
        raise LoRAError(f"lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise LoRAError(f"{folder} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{path} cannot be read: {e}") from None


def _place(adapter: LoRAAdapter, model, layers: dict[str, LinearBase], module_name: str, a: torch.Tensor,
           b: torch.Tensor) -> None:
    """Add one module's (A, B) to ``adapter`` under the layer and part(s) it adapts."""
    layer_index = _LAYER.search(module_name)
    if layer_index is not None and int(layer_index.group(1)) not in model.held:
        return  # another pipeline stage's layer
    path, shard = model.checkpoint_module(module_name)
    layer = layers.get(path)
    if layer is None:
        raise LoRAError(f"target module {module_name} is not a linear layer {type(model).__name__} serves "
                        f"LoRA on")
    widths = full_part_widths(layer)
    parts = list(range(len(widths))) if shard is None else [part_index(layer, shard)]
    rows = [widths[i] for i in parts]
    in_full = layer.input_size * (layer.tp.size if isinstance(layer, RowParallelLinear) else 1)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
        raise LoRAError(f"{module_name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not of rank "
                        f"{adapter.rank}")
    if a.shape[1] != in_full or b.shape[0] != sum(rows):
        raise LoRAError(f"{module_name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                        f"{in_full} -> {sum(rows)} layer")
    for i, b_part in zip(parts, b.split(rows)):
        adapter.parts.setdefault(path, {})[i] = (a, b_part)


def part_index(layer: LinearBase, shard) -> int:
    return {"q": 0, "k": 1, "v": 2}[shard] if isinstance(layer, QKVParallelLinear) else int(shard)


def full_part_widths(layer: LinearBase) -> list[int]:
    """The output widths of the layer's parts before tensor parallelism split them (a checkpoint's rows)."""
    size = layer.tp.size
    if isinstance(layer, QKVParallelLinear):
        kv = layer.kv_size * size // layer.kv_replicas
        return [layer.q_size * size, kv, kv]
    if isinstance(layer, MergedColumnParallelLinear):
        return [width * size for width in layer.output_sizes]
    return [layer.output_size * (1 if isinstance(layer, RowParallelLinear) else size)]
