"""Pipeline parallelism: which decoder layers a rank holds, and how hidden states cross stage boundaries.

The model's layers are cut into ``size`` contiguous stages (as even as they go; earlier stages take the
remainder). Stage 0 embeds the tokens, the last stage holds the final norm and the LM head (and, when the
model ties them, its own copy of the embedding matrix as the head's weight). A stage that is not the last
sends its output, ``(x, residual)`` in the decoder layers' convention (the last layer's output not yet added
to the residual stream), to the same tensor-parallel rank of the next stage; that stage receives it instead
of embedding. Every rank builds the same batch, so a receiver knows the shapes without being told.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``rank`` of ``size``; ``previous`` / ``next`` are the global ranks it receives from and sends to."""
    rank: int = 0
    size: int = 1
    previous: int | None = None
    next: int | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers this stage holds."""
        if num_layers < self.size:
            raise ValueError(f"{num_layers} layers cannot be split into {self.size} pipeline stages")
        base, extra = divmod(num_layers, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def receive(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's ``(x, residual)`` for this step's ``num_tokens`` tokens."""
        x = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        torch.distributed.recv(x, src=self.previous)
        return x[0], x[1]

    def send(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand ``(x, residual)`` to the next stage (one message: both in one buffer)."""
        torch.distributed.send(torch.stack([x, residual]), dst=self.next)


WHOLE = PipelineStage()


class MissingLayer(nn.Module):
    """Stands in for a decoder layer another stage holds: no weights, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer lives on another pipeline stage")
