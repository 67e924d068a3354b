"""The compiled CPU decode step: a model's decoder layers as one C call, owned by the runner (as
``cuda_graphs.py`` owns captured graphs on CUDA).

After the weights load and the caches are bound, the runner asks the model once to describe its decoder layers
(``describe_decoder_layers``: ``layers/decode_plan.py``) and builds the C structs once (``kernels.cpu.
DecodeStack``). A step of one-token query rows only (decodes and verification rows, the CPU backend's
``rows_only``), at most the stack's ``max_rows`` of them (any number where every matrix is GGUF blocks), hands
the model this plan as its ``decoder``: the model's one
``forward`` embeds, lets the plan run every layer, and applies its final norm. Other steps, and models whose
layers cannot be described (experts, weight formats the kernels do not read, tensor-parallel shards), run op
by op; the reason is logged once.

Outputs equal the per-op path with the CPU kernels up to the order of fp32 sums (the same roundings to the
model dtype; ``tests/e2e/test_cpu_kernels_identity.py``). With LoRA on, the layers' adapter slots are part of
the description and the step's row -> slot map (their shared ``LoRAStep``) goes into each run: rows that run
adapters take the plan too, each product getting its rows' deltas as ``cpu_lora_delta`` adds them op by op
(``tests/e2e/test_lora_cpu_decode.py``).
"""
from __future__ import annotations

import logging

import torch

from paged_runtime.kernels import cpu as cpu_kernels
from paged_runtime.layers.decode_plan import Undescribable

logger = logging.getLogger(__name__)


class CpuDecodePlan:
    def __init__(self, model, dtype: torch.dtype) -> None:
        """``model``: its attention layers bound to their KV caches (raises Undescribable, or ValueError for a
        description the kernels refuse)."""
        layers = model.describe_decoder_layers()
        self.stack = cpu_kernels.DecodeStack(layers, dtype)
        # the row -> slot map the layers' adapter slots share (one LoRAStep per model), or None: LoRA is off
        self.lora_step = next((m.lora.step for d in layers for m in (d.qkv, d.o, d.gate_up, d.down)
                               if m.lora is not None), None)

    @classmethod
    def build(cls, model, dtype: torch.dtype) -> CpuDecodePlan | None:
        """The plan, or None (logged) where the model's layers cannot run as one call."""
        try:
            return cls(model, dtype)
        except Undescribable as e:
            logger.info("decode steps run op by op: %s", e)
            return None

    def decoder(self, meta):
        """What the model's forward runs its layers with for this step (``run``), or None: op by op."""
        if meta.rows_only and (self.stack.max_rows is None or meta.num_tokens <= self.stack.max_rows):
            return self.run
        return None

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
            meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after the model's layers, in place: x the first layer's input, then the last one's
        output; residual None before the first layer (zeros)."""
        residual = torch.zeros_like(x) if residual is None else residual
        rows = meta.decode_rows
        lora_slots = self.lora_step.row_slots if self.lora_step is not None else None
        self.stack.run(x, residual, positions, meta.slot_mapping, rows.block_tables, rows.context_lens,
                       meta.block_size, lora_slots)
        return x, residual
