"""Linear layers: the weights of ``y = x @ W.T (+ b)``, how they load, and a pluggable ``LinearMethod``.

What ``W`` is in memory (plain, int8, int4, FP8, GGUF blocks) and how it is
multiplied is the layer's ``LinearMethod``: ``create_weights`` registers its
parameters, ``process_weights_after_loading`` turns the loaded tensors into the
form ``apply`` multiplies by (packing, quantizing), ``apply`` multiplies. A new
weight format is a new method; no model file changes.

Sharding (tensor parallelism): a layer is built for rank ``tp.rank`` of
``tp.size``. A column-parallel layer holds a slice of W's rows (output
features); a row-parallel one a slice of its columns (input features), and sums
its partial products over the ranks (one all-reduce). Checkpoint tensors are
full size: the layer's ``weight_loader`` narrows each to the rank's shard and, in
a fused matrix (q/k/v, gate/up), places it at its part's offset. With one rank
every shard is the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_runtime.kernels.cpu import PLAIN
from paged_runtime.layers.ops import TorchOps


@dataclass(frozen=True)
class TensorParallel:
    """Which shard a layer holds: rank ``rank`` of ``size`` (``group`` for the all-reduce when size > 1)."""
    rank: int = 0
    size: int = 1
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def split(self, total: int) -> int:
        if total % self.size:
            raise ValueError(f"{total} does not split evenly over {self.size} tensor-parallel ranks")
        return total // self.size


SINGLE = TensorParallel()


def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (which checks it saw them all).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class LinearMethod:
    """How a linear layer's weights are held and multiplied."""

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        """Register the layer's parameters for its (sharded) ``input_size`` x ``output_size``."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Called once every checkpoint tensor is in place."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def vocab_method(self) -> LinearMethod | None:
        """The method of the embedding and LM head when a model uses this one (None: plain weights)."""
        return None

    def tie(self, layer: nn.Module, embedding: nn.Module) -> None:
        """Make the LM head ``layer`` multiply by ``embedding``'s weights (a model that ties them)."""
        layer.weight = embedding.weight

    def describe(self, layer: LinearBase) -> list[tuple[torch.Tensor, int]] | None:
        """The layer's weight as the compiled decode step reads it (``layers/decode_plan.py``): parts stacked by
        output rows, each (tensor, type): ``PLAIN`` (a [rows, input_size] tensor in the model dtype) or a GGUF
        type id (its blocks); None where the kernels do not read this method's weights."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """Plain weights in the model dtype, multiplied by the op set (which may keep a packed copy)."""

    def __init__(self, ops: TorchOps) -> None:
        self.ops = ops

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = empty_parameter(layer.output_size, layer.input_size, dtype=dtype, device=device)
        layer.packed_weight = None

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        layer.packed_weight = self.ops.pack_weight(layer.weight)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.ops.linear(x, layer.weight, bias, layer.packed_weight)

    def describe(self, layer: LinearBase) -> list[tuple[torch.Tensor, int]]:
        return [(layer.weight, PLAIN)]


class LinearBase(nn.Module):
    """``input_size`` and ``output_size`` are this rank's shard; ``bias`` follows the output shard."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method: LinearMethod, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_size, self.output_size, self.method, self.tp = input_size, output_size, method, tp
        self.lora = None  # this layer's adapter slots, once LoRA is enabled (layers/lora.py)
        method.create_weights(self, dtype, device)
        self.bias = empty_parameter(output_size, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(self.method.apply(self, x, self.bias), x)

    def with_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (the product of ``x``) plus the step's adapters' delta, where this layer has slots."""
        if self.lora is not None:
            self.lora.add(y, x)
        return y

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy one full-size checkpoint tensor's share into ``param``."""
        _copy(param, _from_checkpoint(param, loaded, self.output_size))


class ColumnParallelLinear(LinearBase):
    """W's rows (output features) split over the ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method: LinearMethod, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE) -> None:
        super().__init__(input_size, tp.split(output_size), bias, method, dtype, device, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = _from_checkpoint(param, loaded, param.shape[0] * self.tp.size)
        _copy(param, _shard(loaded, 0, self.tp.rank, param.shape[0], self.tp.size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (gate and up): part i is loaded with shard_id i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, method: LinearMethod,
                 dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE) -> None:
        self.output_sizes = [tp.split(size) for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, method, dtype, device, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.output_sizes[shard_id]
        loaded = _from_checkpoint(param, loaded, size * self.tp.size)
        part = param.narrow(0, sum(self.output_sizes[:shard_id]), size)
        _copy(part, _shard(loaded, 0, self.tp.rank, size, self.tp.size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matrix, split by heads; KV heads are replicated when the ranks
    outnumber them (each rank holds the KV head its query heads read). Loaded with shard_id "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 method: LinearMethod, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE) -> None:
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads)
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)  # ranks that hold the same KV head
        if num_kv_heads >= tp.size:
            tp.split(num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, method, dtype, device, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        rank, num_ranks = self.tp.rank, self.tp.size
        if shard_id != "q":
            rank, num_ranks = rank // self.kv_replicas, num_ranks // self.kv_replicas
        loaded = _from_checkpoint(param, loaded, size * num_ranks)
        _copy(param.narrow(0, offset, size), _shard(loaded, 0, rank, size, num_ranks))


class RowParallelLinear(LinearBase):
    """W's columns (input features) split over the ranks; partial products summed by one all-reduce,
    the bias added once after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method: LinearMethod, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE) -> None:
        super().__init__(tp.split(input_size), output_size, bias, method, dtype, device, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # the bias inside the product: one rounding, as F.linear
            return self.with_lora(self.method.apply(self, x, self.bias), x)
        # Each rank's share of the delta joins its partial product: the all-reduce sums them (layers/lora.py).
        out = self.tp.all_reduce(self.with_lora(self.method.apply(self, x, None), x))
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        loaded = _from_checkpoint(param, loaded, self.output_size)
        if param.dim() == 1:  # the bias is whole on every rank
            _copy(param, loaded)
            return
        _copy(param, _shard(loaded, 1, self.tp.rank, param.shape[1], self.tp.size))


def _from_checkpoint(param: nn.Parameter, loaded: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint tensor in its parameter's orientation: output features along dim 0, input features (or
    their groups) along dim 1. A pre-quantized format's method tags its parameters with ``from_checkpoint(
    tensor, rows)`` (unpack int32 words, transpose, broadcast a per-tensor scale to ``rows``, the output
    features this checkpoint tensor covers), so the loaders above shard and place every format alike."""
    convert = getattr(param, "from_checkpoint", None)
    return loaded if convert is None else convert(loaded, rows)


def _shard(loaded: torch.Tensor, dim: int, rank: int, size: int, num_ranks: int) -> torch.Tensor:
    """Rank ``rank``'s ``size`` slices along ``dim`` of a full tensor of ``size * num_ranks`` (checked)."""
    if loaded.shape[dim] != size * num_ranks:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {size * num_ranks} "
                         f"along dimension {dim}")
    return loaded.narrow(dim, rank * size, size)


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.copy_(loaded)
