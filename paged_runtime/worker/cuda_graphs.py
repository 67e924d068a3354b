"""CUDA graphs for decode-only steps on the Triton backend.

A decode step launches a few hundred small kernels; on a GPU their launch cost, not
the work, sets the step time at small batches. At start-up the forward pass of a
decode-only batch is captured once per size of a ladder (1, 2, 4, 8, then multiples
of 16 and 32 up to ``max_num_seqs``, at most 256), into one memory pool, over static
input buffers. A decode-only step of B tokens copies its inputs into the buffers,
pads to the next captured size and replays; prefill and mixed steps, larger batches
and ``enforce_eager`` run eagerly.

Padding rows are harmless by construction: slot -1 (the store kernel skips it),
position 0, a context of one token through block-table row entries that already
exist. Whatever the captured kernels size on the host is fixed per graph: one query
per sequence, and the split-KV segment count that ``max_model_len`` would choose
(segments past a shorter context are empty and weigh nothing in the reduction).

LoRA (``lora_step``): the graphs capture the adapters' shrink / expand launches over a static row -> slot
buffer, which each replay fills from the step's map (-1 for base-model and padding rows, whose programs
return at once), so steps that mix adapters replay too; the slot tables themselves are the layers' own
tensors, loaded in place (``lora/slots.py``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from paged_runtime.attention.triton_backend import TritonAttentionMetadata

LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

# capture(fn, pool) -> (replay, output): run fn under capture; replay() re-runs it into output.
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


def capture_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, LADDER[-1])
    return [s for s in LADDER if s < largest] + [largest]


class DecodeGraphs:
    def __init__(self, model, block_size: int, max_num_seqs: int, max_model_len: int, device: torch.device,
                 capture: Capture = cuda_capture, lora_step=None) -> None:
        """``model``: its attention layers already bound to their KV caches; ``lora_step``: its LoRA layers'
        shared step (``layers/lora.LoRAStep``), or None: LoRA is off."""
        from paged_runtime.kernels.triton_ops import num_kv_splits
        self.model, self.block_size = model, block_size
        self.sizes = capture_sizes(max_num_seqs)
        size, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)
        self.input_ids, self.positions = zeros(size, dtype=torch.int64), zeros(size, dtype=torch.int64)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = zeros(size, max_blocks, dtype=torch.int32)
        query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        kv_heads = model.config.num_kv_heads
        self.metas = {s: TritonAttentionMetadata(
            self.slot_mapping[:s], query_start_loc[:s + 1], self.seq_lens[:s], self.block_tables[:s], block_size,
            max_query_len=1, max_seq_len=max_model_len, num_kv_splits=num_kv_splits(s, kv_heads, 1, max_model_len))
            for s in self.sizes}
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._capture = capture
        self.lora_step = lora_step
        self.row_slots = torch.full((size,), -1, dtype=torch.int64, device=device) if lora_step else None

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Largest first, so the smaller graphs reuse the pool the largest one allocated."""
        pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        for size in reversed(self.sizes):
            forward = lambda s=size: self._forward(s)
            forward()  # warm-up: Triton compiles and autotunes outside the capture
            self.graphs[size] = self._capture(forward, pool)

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the static buffers of ``size`` rows (LoRA's slots read from its static buffer)."""
        if self.lora_step is None:
            return self.model(self.input_ids[:size], self.positions[:size], self.metas[size])
        step_slots, self.lora_step.row_slots = self.lora_step.row_slots, self.row_slots[:size]
        try:
            return self.model(self.input_ids[:size], self.positions[:size], self.metas[size])
        finally:
            self.lora_step.row_slots = step_slots

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """The step's hidden states from a replayed graph, or None when it must run eagerly. They live in the
        shared graph pool: valid until the next replay of any size, so the step reads them before then."""
        batch = input_ids.shape[0]
        if not isinstance(meta, TritonAttentionMetadata) or meta.max_query_len != 1 or batch > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.block_tables[:batch, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        # Padding rows: the previous step's may hold real slots; they must not store.
        self.input_ids[batch:size].zero_()
        self.positions[batch:size].zero_()
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[batch:size].fill_(1)
        if self.lora_step is not None:
            self._fill_row_slots(batch, size)
        replay, out = self.graphs[size]
        replay()
        return out[:batch]

    def _fill_row_slots(self, batch: int, size: int) -> None:
        """The static row -> slot buffer from the step's map (-1: no adapter; padding rows too)."""
        slots = self.lora_step.row_slots
        if slots is None:
            self.row_slots[:size].fill_(-1)
            return
        self.row_slots[:batch].copy_(slots)
        self.row_slots[batch:size].fill_(-1)
