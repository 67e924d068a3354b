"""RMSNorm (Llama's; Gemma's 1 + w) with the residual add fused in: ``norm(x, residual) -> (normed, residual + x)``;
LayerNorm (BERT's post-norms), plain."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_runtime.layers.linear import empty_parameter
from paged_runtime.layers.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: TorchOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_parameter(size, dtype=dtype, device=device)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual, (norm(x), x)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w - 1 (the norm scales by ``1 + weight``), applied in fp32."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.gemma_rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """``F.layer_norm`` with a weight and a bias, in the model dtype (as ``nn.LayerNorm``; torch computes in float32
    inside)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_parameter(size, dtype=dtype, device=device)
        self.bias = empty_parameter(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
