"""Executes a scheduled step: flat batch in, one sampled token per finished chunk out.

The runner never decides who runs. It turns a ``SchedulerOutput`` into flat
tensors (token ids, positions, slot mapping, attention metadata), runs the
model, computes logits only where a token is sampled, and samples. Inputs
are built with numpy over whole arrays, not per token.
"""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.attention.torch_backend import AttentionMetadata, PrefillChunk, causal_mask, decode_group
from paged_runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.sample.sampler import Sampler, SamplingMetadata


# Decodes are attended in groups of this many rows (sorted by length), so one
# long context does not pad everyone else's gather to its length.
DECODE_GROUP_SIZE = 32


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, seed: int) -> None:
        c = model.config
        self.model, self.block_size, self.device = model, block_size, device
        shape = (2, num_blocks * block_size, c.num_kv_heads, c.head_dim)
        # Zeroed, not empty: masked-out context slots are still multiplied by 0 in attention.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """Returns, in the scheduler's order, the sampled token or None for a partial prompt chunk."""
        for request_id in out.finished_req_ids:
            self.generators.pop(request_id, None)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        # Decodes first, shortest context first, so attention can batch neighbours of similar length.
        order = sorted(range(len(out.scheduled)),
                       key=lambda i: (out.scheduled[i].num_new_tokens > 1, out.scheduled[i].start))
        items = [out.scheduled[i] for i in order]
        input_ids, positions, meta = self._prepare_inputs(items)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sample_rows = np.cumsum([s.num_new_tokens for s in items]) - 1
        sampling = [k for k, s in enumerate(items) if s.samples]
        tokens: list[int | None] = [None] * len(items)
        if sampling:
            rows = torch.as_tensor(sample_rows[sampling], device=self.device)
            logits = self.model.compute_logits(hidden[rows])
            sampled = self.sampler(logits, self._sampling_metadata([items[k] for k in sampling])).tolist()
            for k, token in zip(sampling, sampled):
                tokens[k] = token
        result: list[int | None] = [None] * len(items)
        for k, i in enumerate(order):
            result[i] = tokens[k]
        return result

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each (src, dst) pair's dst block the KV of src, in every layer."""
        offsets = np.arange(self.block_size)
        src, dst = (torch.from_numpy((np.asarray(b)[:, None] * self.block_size + offsets).ravel()).to(self.device)
                    for b in zip(*copies))
        for kv_cache in self.kv_caches:
            kv_cache[:, dst] = kv_cache[:, src]

    # ---- inputs ------------------------------------------------------------------
    def _prepare_inputs(self, items: list[ScheduledRequest]):
        decodes = [s for s in items if s.num_new_tokens == 1]
        prefills = items[len(decodes):]
        ids, pos, slots = [], [], []
        groups = []
        if decodes:
            d_ids, d_pos, d_slots, groups = self._decode_inputs(decodes)
            ids.append(d_ids), pos.append(d_pos), slots.append(d_slots)
        chunks = []
        start = len(decodes)
        for s in prefills:
            p = np.arange(s.start, s.start + s.num_new_tokens)
            table = np.asarray(s.block_ids)
            ids.append(np.asarray(s.request.all_token_ids[s.start:s.start + s.num_new_tokens]))
            pos.append(p)
            slots.append(self._slots(table, p))
            chunks.append(self._prefill_chunk(start, s, table))
            start += s.num_new_tokens
        to = lambda a: torch.from_numpy(np.concatenate(a).astype(np.int64)).to(self.device)
        return to(ids), to(pos), AttentionMetadata(to(slots), groups, chunks)

    def _slots(self, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return table[..., positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_inputs(self, decodes: list[ScheduledRequest]):
        starts = np.fromiter((s.start for s in decodes), dtype=np.int64, count=len(decodes))
        token_ids = np.fromiter((s.request.all_token_ids[s.start] for s in decodes), np.int64, len(decodes))
        max_blocks = max(len(s.block_ids) for s in decodes)
        tables = np.zeros((len(decodes), max_blocks), dtype=np.int64)
        for row, s in zip(tables, decodes):
            row[:len(s.block_ids)] = s.block_ids
        rows = np.arange(len(decodes))
        slots = tables[rows, starts // self.block_size] * self.block_size + starts % self.block_size
        groups = []
        for first in range(0, len(decodes), DECODE_GROUP_SIZE):
            lens = starts[first:first + DECODE_GROUP_SIZE] + 1  # sorted ascending: the last is the longest
            gather = self._slots(tables[first:first + DECODE_GROUP_SIZE], np.arange(int(lens[-1])))
            groups.append(decode_group(first, torch.from_numpy(gather).to(self.device),
                                       torch.from_numpy(lens).to(self.device)))
        return token_ids, starts, slots, groups

    def _prefill_chunk(self, query_start: int, s: ScheduledRequest, table: np.ndarray) -> PrefillChunk:
        if s.start == 0:
            return PrefillChunk(query_start, s.num_new_tokens, None, None)
        context_len = s.start + s.num_new_tokens
        context = torch.from_numpy(self._slots(table, np.arange(context_len))).to(self.device)
        return PrefillChunk(query_start, s.num_new_tokens, context,
                            causal_mask(s.num_new_tokens, context_len, self.device))

    # ---- sampling ----------------------------------------------------------------
    def _sampling_metadata(self, items: list[ScheduledRequest]) -> SamplingMetadata:
        params = [s.request.params for s in items]
        all_greedy = all(p.greedy for p in params)
        vocab = self.model.config.vocab_size
        top_k = top_p = None
        if not all_greedy and any(p.top_k for p in params):
            top_k = torch.tensor([p.top_k or vocab for p in params], device=self.device)
        if not all_greedy and any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        generators = [self._generator(s) for s in items]
        return SamplingMetadata(temperature, top_k, top_p, generators, all_greedy)

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        seed = s.request.params.seed
        if seed is None or s.request.params.greedy:
            return None
        g = self.generators.get(s.request.request_id)
        if g is None:
            g = self.generators[s.request.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g
