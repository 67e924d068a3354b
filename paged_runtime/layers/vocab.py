"""Token embedding and LM head, split over tensor-parallel ranks by vocabulary rows.

Rank r holds rows ``[r * per_rank, (r + 1) * per_rank)`` of the (padded) vocabulary. The embedding
zeroes the ids outside its rows and sums over the ranks; the LM head gathers every rank's logits.
``ScaledEmbedding`` multiplies by a constant (Gemma's sqrt(hidden)); ``ParallelLMHead.softcap`` soft-caps logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_runtime.layers.linear import SINGLE, LinearMethod, TensorParallel, empty_parameter


class VocabParallelEmbedding(nn.Module):
    """``method``: how the rows are held (None: a plain weight; a quantized method looks rows up itself)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, method: LinearMethod | None = None) -> None:
        super().__init__()
        self.vocab_size, self.tp, self.method = vocab_size, tp, method
        self.per_rank = -(-vocab_size // tp.size)
        self.first = tp.rank * self.per_rank
        self.output_size, self.input_size = self.per_rank, hidden_size  # as a linear layer's W: [rows, hidden]
        if method is None:
            self.weight = empty_parameter(self.per_rank, hidden_size, dtype=dtype, device=device)
        else:
            method.create_weights(self, dtype, device)

    def process_weights_after_loading(self) -> None:
        if self.method is not None:
            self.method.process_weights_after_loading(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.first:self.first + self.per_rank]
        if rows.shape[1:] != param.shape[1:] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected ({self.vocab_size}, {param.shape[1]})")
        param[:rows.shape[0]].copy_(rows)
        param[rows.shape[0]:].zero_()  # padding rows past the vocabulary

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.method is not None:
            return self.method.embed(self, input_ids)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the rows that are sampled; its matrix is the embedding's when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, method: LinearMethod, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, dtype, device, tp, method)
        self.bias = None
        self.softcap: float | None = None  # c: logits -> c * tanh(logits / c), in the model dtype (Gemma)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.method.tie(self, embedding)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, hidden, None)
        if self.tp.size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp.size)]
            torch.distributed.all_gather(parts, logits, group=self.tp.group)
            logits = torch.cat(parts, dim=-1)
        logits = logits[:, :self.vocab_size]
        if self.softcap is not None:  # before the fp32 cast: Hugging Face rounds here in the model dtype
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


class ScaledEmbedding(VocabParallelEmbedding):
    """Embeddings times ``scale``, rounded to the weight dtype first (as Hugging Face's Gemma: sqrt(1152) is
    33.94 in fp32 but 34.0 in bfloat16)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = SINGLE, method: LinearMethod | None = None) -> None:
        super().__init__(vocab_size, hidden_size, dtype, device, tp, method)
        self.register_buffer("scale", torch.tensor(scale).to(device=device, dtype=dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale
