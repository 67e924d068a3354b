"""Executes a scheduled step: flat batch in, one sampled token per finished chunk out.

The runner never decides who runs. It turns a ``SchedulerOutput`` into flat
tensors (token ids, positions, slot mapping, attention metadata), runs the
model, computes logits only where a token is sampled, and samples. Inputs
are built with numpy over whole arrays, not per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_runtime.attention.torch_backend import AttentionMetadata, PrefillChunk, causal_mask, decode_group
from paged_runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.sample.metadata import build_sampling_metadata
from paged_runtime.sample.sampler import Sampler, SamplerOutput
from paged_runtime.utils.cpu import keep_freed_memory_mapped


@dataclass(slots=True)
class TokenLogprobs:
    """Raw logprob and rank of one token, and the top-k alternatives at its position."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RunnerOutput:
    """Per scheduled request, in the scheduler's order."""
    token_ids: list[int | None]  # None: a prompt chunk that did not reach the end
    logprobs: list[TokenLogprobs | None]
    # (first prompt position scored, entries): entry i scores prompt token first + i + 1.
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None]


# Decodes are attended in groups of this many rows (sorted by length), so one
# long context does not pad everyone else's gather to its length.
DECODE_GROUP_SIZE = 32


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, seed: int) -> None:
        c = model.config
        self.model, self.block_size, self.device = model, block_size, device
        if device.type == "cpu":
            keep_freed_memory_mapped()
        shape = (num_blocks * block_size, 2, c.num_kv_heads, c.head_dim)
        # Zeroed, not empty: masked-out context slots are still multiplied by 0 in attention.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
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
        ends = np.cumsum([s.num_new_tokens for s in items])
        result = RunnerOutput([None] * len(items), [None] * len(items), [None] * len(items))
        sampling = [k for k, s in enumerate(items) if s.samples]
        if sampling:
            rows = torch.as_tensor(ends[sampling] - 1, device=self.device)
            requests = [items[k].request for k in sampling]
            generators = [self._generator(r) for r in requests]
            meta = build_sampling_metadata(requests, generators, self.model.config.vocab_size, self.device)
            sampled = self.sampler(self.model.compute_logits(hidden[rows]), meta)
            self._store_samples(result, sampling, requests, sampled)
        for k, s in enumerate(items):
            if s.request.params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens - 1:
                result.prompt_logprobs[k] = self._prompt_logprobs(s, hidden[ends[k] - s.num_new_tokens:ends[k]])
        back = np.argsort(order)  # from the runner's order back to the scheduler's
        return RunnerOutput(*([field[k] for k in back]
                              for field in (result.token_ids, result.logprobs, result.prompt_logprobs)))

    @staticmethod
    def _store_samples(result: RunnerOutput, positions: list[int], requests, sampled: SamplerOutput) -> None:
        tokens = sampled.token_ids.tolist()
        if sampled.logprobs is not None:
            logprobs, ranks = sampled.logprobs.tolist(), sampled.ranks.tolist()
            top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
            top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        for j, (k, request) in enumerate(zip(positions, requests)):
            result.token_ids[k] = tokens[j]
            if sampled.logprobs is not None and request.params.needs_logprobs:
                num = request.params.logprobs or 0
                result.logprobs[k] = TokenLogprobs(tokens[j], logprobs[j], ranks[j],
                                                   top_ids[j][:num] if num else [], top_lps[j][:num] if num else [])

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor) -> tuple[int, list[TokenLogprobs]]:
        """Score prompt tokens start+1 .. (chunk end or the prompt's last) from this chunk's rows."""
        request = s.request
        end = min(s.start + s.num_new_tokens, request.num_prompt_tokens - 1)
        logprobs = self.model.compute_logits(hidden[:end - s.start]).log_softmax(dim=-1)
        targets = torch.tensor(request.prompt_token_ids[s.start + 1:end + 1], device=self.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
        k = request.params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        top_ids = top.indices.tolist() if top else [[] for _ in ranks]
        top_lps = top.values.tolist() if top else [[] for _ in ranks]
        entries = [TokenLogprobs(t, lp, r, i, v)
                   for t, lp, r, i, v in zip(targets.tolist(), chosen.tolist(), ranks, top_ids, top_lps)]
        return s.start, entries

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each (src, dst) pair's dst block the KV of src, in every layer."""
        offsets = np.arange(self.block_size)
        src, dst = (torch.from_numpy((np.asarray(b)[:, None] * self.block_size + offsets).ravel()).to(self.device)
                    for b in zip(*copies))
        for kv_cache in self.kv_caches:
            kv_cache[dst] = kv_cache[src]

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
    def _generator(self, request) -> torch.Generator | None:
        """A seeded request's own generator; a forked child i draws from seed + i."""
        seed = request.params.seed
        if seed is None or request.params.greedy:
            return None
        g = self.generators.get(request.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed + request.index)
            self.generators[request.request_id] = g
        return g
