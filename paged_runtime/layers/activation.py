"""Gated activations over a fused [gate | up] row block: SwiGLU (Llama) and GeGLU (Gemma)."""
from __future__ import annotations

import torch
from torch import nn

from paged_runtime.layers.ops import TorchOps


class SiluAndMul(nn.Module):
    """silu(gate) * up, for x = [gate | up] along the last dimension."""

    def __init__(self, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU, gelu(gate) * up with gelu's tanh approximation (Hugging Face's "gelu_pytorch_tanh"; Gemma)."""

    def __init__(self, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_mul(x)
