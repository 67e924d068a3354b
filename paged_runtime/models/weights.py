"""Placing checkpoint tensors into a model's parameters, for every family's ``load_weight`` / ``expected_weights``.

A family maps a checkpoint name to one of its parameters (``module_path.param_name``, and for a fused matrix the
part ``shard``: "q" / "k" / "v" of a ``QKVParallelLinear``, 0 / 1 of a ``MergedColumnParallelLinear``);
``load_parameter`` copies the tensor there and names what it filled (``"path.param"`` or ``"path.param#shard"``),
and ``expected_parameters`` lists every such name the model must be given, which the loader compares.
"""
from __future__ import annotations

import torch
from torch import nn

from paged_runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear


def load_parameter(model: nn.Module, module_path: str, param_name: str, tensor: torch.Tensor, shard=None,
                   name: str = "") -> str | None:
    """Copy checkpoint tensor ``name`` into ``model``'s ``module_path.param_name`` (part ``shard`` of a fused
    matrix) through the parameter's or its module's ``weight_loader`` (sharding, fused parts, quantized formats),
    else as is (same shape, checked); what it filled, or None when the model has no such parameter."""
    try:
        module = model.get_submodule(module_path)
        param = getattr(module, param_name)
    except AttributeError:
        return None
    if not isinstance(param, nn.Parameter):
        return None
    # A parameter may bring its own loader (a quantized format's tensors are not the layer's plain shape).
    loader = getattr(param, "weight_loader", None) or getattr(module, "weight_loader", None)
    if loader is None:
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(tensor)
    else:
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name}: {e}") from e
    target = f"{module_path}.{param_name}"
    return target if shard is None else f"{target}#{shard}"


def expected_parameters(model: nn.Module, skip: nn.Module | None = None) -> set[str]:
    """Every name ``load_parameter`` must return for ``model`` to be complete (each part of a fused matrix
    apart), except ``skip``'s parameters (a tied LM head's)."""
    names = set()
    for module_path, module in model.named_modules():
        if module is skip:
            continue
        shards = ("q", "k", "v") if isinstance(module, QKVParallelLinear) else (
            (0, 1) if isinstance(module, MergedColumnParallelLinear) else (None,))
        for param_name, _ in module.named_parameters(recurse=False):
            names.update(f"{module_path}.{param_name}" + ("" if s is None else f"#{s}") for s in shards)
    return names
