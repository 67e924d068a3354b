"""A linear layer's LoRA slots: what ``LinearBase.forward`` adds to its product when a step's rows run adapters.

``enable_lora(model, ...)`` gives every LoRA-capable linear layer of a model (its decoder layers' q/k/v, o,
gate/up and down: ``LinearBase``, not the embedding, the LM head or experts) a ``LoRAWeights``: zeroed slot
tensors ``a`` [S, N*R, in] and ``b`` [S, out, R] for this rank's shard, ``S`` = max_loras slots of rank up to
``R`` = max_lora_rank, ``N`` the layer's parts (q, k, v; gate, up; one). All layers share one ``LoRAStep``:
the step's row -> slot map, which the runner sets before each forward pass (None: no row runs an adapter, and
the layers add nothing). What a slot holds is ``lora/slots.py``'s business; the product is the op set's
``lora_delta`` (``layers/ops.py``).

Tensor parallelism shards an adapter like its base layer: a column-parallel layer keeps all of A and its
output rows of B, a row-parallel one its input columns of A and all of B, and adds its partial delta before
the layer's all-reduce, which sums the ranks' shares into the whole delta.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_runtime.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear


@dataclass
class LoRAStep:
    """The step's row -> slot map ([T] int64 on the device, -1: the base model), or None: no adapter runs."""
    row_slots: torch.Tensor | None = None


class LoRAWeights:
    def __init__(self, layer: LinearBase, num_slots: int, max_rank: int, step: LoRAStep, ops, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slices = tuple(part_widths(layer))
        self.rank, self.step, self.ops = max_rank, step, ops
        self.a = torch.zeros(num_slots, len(self.slices) * max_rank, layer.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, layer.output_size, max_rank, dtype=dtype, device=device)

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Add this step's adapters' delta to ``y`` (the layer's product of ``x``), in place."""
        if self.step.row_slots is not None:
            self.ops.lora_delta(y, x, self.a, self.b, self.step.row_slots, self.slices)


def part_widths(layer: LinearBase) -> list[int]:
    """This rank's output widths of the layer's parts, in their order along the output."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.output_sizes)
    return [layer.output_size]


def lora_layers(model: nn.Module) -> dict[str, LinearBase]:
    """Every linear layer of ``model``'s decoder layers an adapter may target, by module path."""
    return {path: m for path, m in model.named_modules()
            if isinstance(m, LinearBase) and ".layers." in f".{path}"}


def enable_lora(model: nn.Module, num_slots: int, max_rank: int, ops, dtype: torch.dtype,
                device: torch.device) -> LoRAStep:
    """Give each of ``model``'s LoRA-capable layers its zeroed slots (in ``dtype``, the activations'); the step
    they all read."""
    step = LoRAStep()
    for layer in lora_layers(model).values():
        layer.lora = LoRAWeights(layer, num_slots, max_rank, step, ops, dtype, device)
    return step
