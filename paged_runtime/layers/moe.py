"""Mixture of experts: a router picks ``top_k`` of ``num_experts`` SwiGLU MLPs per token, and the token's
output is the routing-weighted sum of theirs.

``FusedMoE`` holds every expert's weights stacked, one parameter per kind: ``w13_weight`` [E, 2 * I, H]
(each expert's gate rows, then its up rows) and ``w2_weight`` [E, H, I]. The product itself is the op
set's (``ops.fused_moe``): the step's (token, expert) routes grouped by expert, each expert's rows one
matrix product, no per-token Python. ``SparseMoeBlock`` is the router (a linear "gate") plus the experts,
under the names Hugging Face checkpoints use (``gate``, ``experts``).

Routing follows Hugging Face step for step: logits in the model dtype, softmax in float32, top-k, the
family's renormalisation of the k weights, and the weights either kept in float32 (Mixtral) or rounded
to the model dtype (Qwen3-MoE, OLMoE) before they scale the experts' outputs.

Tensor parallelism: each rank holds a slice of every expert's intermediate dimension (w13's rows, w2's
columns), so its weighted sum is a partial one, completed by one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from paged_runtime.layers.decode_plan import Undescribable
from paged_runtime.layers.linear import SINGLE, LinearBase, LinearMethod, TensorParallel, empty_parameter
from paged_runtime.layers.ops import TorchOps

# Checkpoint shard ids of one expert (vLLM's names): w1 the gate projection, w3 the up one, w2 the down one.
EXPERT_SHARDS = ("w1", "w3", "w2")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts ([T, k] ids) and their weights, as Hugging Face routes: softmax in float32,
    top-k, optionally divided by their sum (in float32), then cast to ``weights_dtype``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class FusedMoE(nn.Module):
    """The experts of one layer: ``forward(x, router_logits)`` routes and sums; weights load per expert."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 ops: TorchOps, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE,
                 fp32_routing_weights: bool = False) -> None:
        """``fp32_routing_weights``: scale the experts' outputs by float32 weights (Mixtral) instead of weights
        rounded to the model dtype (Qwen3-MoE, OLMoE); the product is rounded to the model dtype either way."""
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"top_k {top_k} exceeds the {num_experts} experts")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = tp.split(intermediate_size)  # this rank's slice of each expert
        self.ops, self.tp, self.fp32_routing_weights = ops, tp, fp32_routing_weights
        self.w13_weight = empty_parameter(num_experts, 2 * self.intermediate_size, hidden_size, dtype=dtype,
                                          device=device)
        self.w2_weight = empty_parameter(num_experts, hidden_size, self.intermediate_size, dtype=dtype,
                                         device=device)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights_dtype = torch.float32 if self.fp32_routing_weights else router_logits.dtype
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, weights_dtype)
        return self.tp.all_reduce(self.ops.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
        """Copy expert ``expert_id``'s full-size ``shard_id`` matrix (w1 / w3: [I, H], w2: [H, I]) into its
        place in ``param``, narrowed to this rank's slice of the intermediate dimension."""
        if shard_id not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard_id!r}; expected one of {EXPERT_SHARDS}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} is out of range: this layer has {self.num_experts}")
        size, rank = self.intermediate_size, self.tp.rank
        dim = 1 if shard_id == "w2" else 0  # the intermediate dimension of the checkpoint matrix
        if loaded.dim() != 2 or loaded.shape[dim] != size * self.tp.size:
            raise ValueError(f"expert tensor has shape {tuple(loaded.shape)}, expected {size * self.tp.size} "
                             f"along dimension {dim}")
        target = param[expert_id]
        if shard_id != "w2":
            target = target.narrow(0, 0 if shard_id == "w1" else size, size)
        part = loaded.narrow(dim, rank * size, size)
        if target.shape != part.shape:
            raise ValueError(f"expert tensor has shape {tuple(loaded.shape)}, expected {tuple(target.shape)} "
                             f"(this rank's slice)")
        target.copy_(part)

    @staticmethod
    def param_name(shard_id: str) -> str:
        """The parameter a checkpoint shard loads into."""
        return "w2_weight" if shard_id == "w2" else "w13_weight"

    def checkpoint_shards(self) -> list[str]:
        """What a complete checkpoint fills, as the models' ``load_weight`` reports it: "param#expert.shard"."""
        return [f"{self.param_name(s)}#{e}.{s}" for e in range(self.num_experts) for s in EXPERT_SHARDS]


class SparseMoeBlock(nn.Module):
    """The router (``gate``: hidden -> one logit per expert, whole on every rank) and the experts."""

    def __init__(self, experts: FusedMoE, hidden_size: int, method: LinearMethod, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.gate = LinearBase(hidden_size, experts.num_experts, False, method, dtype, device)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))

    def describe(self) -> dict:
        raise Undescribable("mixture-of-experts layers are not in the compiled decode step")
