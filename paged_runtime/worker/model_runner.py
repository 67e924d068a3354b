"""Executes a scheduled step: flat batch in, new tokens out.

The runner never decides who runs. It turns a ``SchedulerOutput`` into flat
tensors (token ids, positions, slot mapping, attention metadata), runs the
model, computes logits only where a token is sampled, and samples: one token
per chunk that reaches its request's end, or, for a speculating request, the
drafts the rejection sampler accepts plus one (a draft model, when configured,
proposes them first in the same step). Inputs are built with numpy over whole
arrays, not per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from paged_runtime.attention import select_backend, triton_backend
from paged_runtime.attention.torch_backend import (AttentionMetadata, KernelDecodeGroup, PrefillChunk,
                                                   VerifyGroup, causal_mask, decode_group)
from paged_runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.sample.metadata import build_sampling_metadata
from paged_runtime.sample.sampler import Sampler, SamplerOutput
from paged_runtime.spec_decode.draft_model import DraftModelProposer
from paged_runtime.spec_decode.rejection_sampler import RejectionSampler, SpecRow
from paged_runtime.utils.cpu import huge_page_zeros, keep_freed_memory_mapped
from paged_runtime.worker.cuda_graphs import DecodeGraphs


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
    # Empty: a prompt chunk that did not reach the end; one token for a plain decode;
    # accepted drafts + one for a speculating request.
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]  # one entry per token, when the request asks
    # (first prompt position scored, entries): entry i scores prompt token first + i + 1.
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None]


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Entry i: token_ids[i]'s logprob and rank in row i of ``logprobs``, and the row's top ``num_top``."""
    targets = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    top_ids = top.indices.tolist() if top else [[] for _ in ranks]
    top_lps = top.values.tolist() if top else [[] for _ in ranks]
    return [TokenLogprobs(t, lp, r, i, v) for t, lp, r, i, v in zip(token_ids, chosen.tolist(), ranks, top_ids, top_lps)]


def _layout_rank(s: ScheduledRequest) -> int:
    """Where an item goes in the flat batch: 0 single-token decode, 1 verification, 2 prompt chunk."""
    return 1 if s.num_spec else (0 if s.num_scheduled == 1 else 2)


# Decodes are attended in groups of this many rows (sorted by length), so one
# long context does not pad everyone else's gather to its length.
DECODE_GROUP_SIZE = 32


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, seed: int, drafter: DraftModelProposer | None = None,
                 graphs: tuple[int, int] | None = None) -> None:
        """``graphs``: (max_num_seqs, max_model_len) to capture CUDA graphs for decode steps (Triton backend
        on CUDA only; see ``cuda_graphs``); None runs every step eagerly."""
        c = model.config
        self.model, self.block_size, self.device = model, block_size, device
        self.attention_backend = select_backend(device)
        if device.type == "cpu":
            keep_freed_memory_mapped()
        shape = (num_blocks * block_size, 2, c.num_kv_heads, c.head_dim)
        # Zeroed, not empty: masked-out context slots are still multiplied by 0 in attention.
        zeros = (lambda: huge_page_zeros(shape, dtype)) if device.type == "cpu" else (
            lambda: torch.zeros(shape, dtype=dtype, device=device))
        self.kv_caches = [zeros() for _ in range(c.num_layers)]
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.drafter = drafter
        self.generators: dict[str, torch.Generator] = {}
        self.graphs = None
        if graphs is not None and self.attention_backend == "triton":
            self.graphs = DecodeGraphs(model, self.kv_caches, block_size, *graphs, device)
            self.graphs.capture_all()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for request_id in out.finished_req_ids:
            self.generators.pop(request_id, None)
            if self.drafter is not None:
                self.drafter.forget(request_id)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        # Decodes, then verifications, then prompt chunks; shortest context first within each, so
        # attention can batch neighbours of similar length.
        order = sorted(range(len(out.scheduled)), key=lambda i: (_layout_rank(out.scheduled[i]), out.scheduled[i].start))
        items = [out.scheduled[i] for i in order]
        spec_rows = {k: self._spec_row(s) for k, s in enumerate(items) if s.num_spec}
        if self.drafter is not None:
            self.drafter.propose(items, spec_rows, self.prepare_inputs, self.sampler.generator)
            for k, row in spec_rows.items():
                items[k].spec_token_ids = row.drafts
        input_ids, positions, meta = self.prepare_inputs(items)
        hidden = self.graphs.run(input_ids, positions, meta) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        ends = np.cumsum([s.num_scheduled for s in items])
        result = RunnerOutput([[] for _ in items], [None] * len(items), [None] * len(items))
        sampling = [k for k, s in enumerate(items) if s.samples and not s.num_spec]
        if sampling:
            rows = torch.as_tensor(ends[sampling] - 1, device=self.device)
            requests = [items[k].request for k in sampling]
            generators = [self._generator(r) for r in requests]
            meta = build_sampling_metadata(requests, generators, self.model.config.vocab_size, self.device)
            sampled = self.sampler(self.model.compute_logits(hidden[rows]), meta)
            self._store_samples(result, sampling, requests, sampled)
        if spec_rows:
            self._verify(items, spec_rows, hidden, ends, result)
        for k, s in enumerate(items):
            if s.request.params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens - 1:
                result.prompt_logprobs[k] = self._prompt_logprobs(s, hidden[ends[k] - s.num_new_tokens:ends[k]])
        back = np.argsort(order)  # from the runner's order back to the scheduler's
        return RunnerOutput(*([field[k] for k in back]
                              for field in (result.token_ids, result.logprobs, result.prompt_logprobs)))

    def _spec_row(self, s: ScheduledRequest) -> SpecRow:
        p = s.request.params
        return SpecRow(0, list(s.spec_token_ids), None, p.temperature, p.top_k, p.top_p, p.min_p,
                       self._generator(s.request))

    def _verify(self, items: list[ScheduledRequest], spec_rows: dict[int, SpecRow], hidden: torch.Tensor,
                ends: np.ndarray, result: RunnerOutput) -> None:
        """Score each speculating request's last token and drafts; keep what the rejection sampler accepts."""
        spans, first = [], 0
        for k, row in spec_rows.items():
            span = np.arange(ends[k] - items[k].num_spec - 1, ends[k])
            spans.append(span)
            row.first_row, first = first, first + len(span)
        logits = self.model.compute_logits(hidden[torch.as_tensor(np.concatenate(spans), device=self.device)]).float()
        emitted = self.rejection_sampler(logits, list(spec_rows.values()))
        for (k, row), tokens in zip(spec_rows.items(), emitted):
            result.token_ids[k] = tokens
            if self.drafter is not None:
                self.drafter.accepted(items[k], len(tokens) - 1)
            if items[k].request.params.needs_logprobs:
                scored = logits[row.first_row:row.first_row + len(tokens)].log_softmax(dim=-1)
                result.logprobs[k] = token_logprobs(scored, tokens, items[k].request.params.logprobs or 0)

    @staticmethod
    def _store_samples(result: RunnerOutput, positions: list[int], requests, sampled: SamplerOutput) -> None:
        tokens = sampled.token_ids.tolist()
        if sampled.logprobs is not None:
            logprobs, ranks = sampled.logprobs.tolist(), sampled.ranks.tolist()
            top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
            top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        for j, (k, request) in enumerate(zip(positions, requests)):
            result.token_ids[k] = [tokens[j]]
            if sampled.logprobs is not None and request.params.needs_logprobs:
                num = request.params.logprobs or 0
                result.logprobs[k] = [TokenLogprobs(tokens[j], logprobs[j], ranks[j],
                                                    top_ids[j][:num] if num else [], top_lps[j][:num] if num else [])]

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor) -> tuple[int, list[TokenLogprobs]]:
        """Score prompt tokens start+1 .. (chunk end or the prompt's last) from this chunk's rows."""
        request = s.request
        end = min(s.start + s.num_new_tokens, request.num_prompt_tokens - 1)
        logprobs = self.model.compute_logits(hidden[:end - s.start]).log_softmax(dim=-1)
        targets = request.prompt_token_ids[s.start + 1:end + 1]
        return s.start, token_logprobs(logprobs, targets, request.params.prompt_logprobs)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each (src, dst) pair's dst block the KV of src, in every layer."""
        offsets = np.arange(self.block_size)
        src, dst = (torch.from_numpy((np.asarray(b)[:, None] * self.block_size + offsets).ravel()).to(self.device)
                    for b in zip(*copies))
        for kv_cache in self.kv_caches:
            kv_cache[dst] = kv_cache[src]
        if self.drafter is not None:
            self.drafter.copy_slots(src, dst)

    # ---- inputs ------------------------------------------------------------------
    def prepare_inputs(self, items: list[ScheduledRequest]):
        """Flat token ids, positions and attention metadata; ``items`` hold single-token queries first,
        then speculating requests, then multi-token chunks, each part by ascending start."""
        if self.attention_backend == "triton":
            return self._varlen_inputs(items)
        ranks = [_layout_rank(s) for s in items]
        decodes, verifies = items[:ranks.count(0)], items[ranks.count(0):ranks.count(0) + ranks.count(1)]
        prefills = items[len(decodes) + len(verifies):]
        ids, pos, slots, groups = [], [], [], []
        if self.model.ops.native and (decodes or verifies):
            # The CPU kernel takes decodes and verifications alike: one query row per token.
            k_ids, k_pos, k_slots, group = self._kernel_rows(decodes + verifies)
            ids.append(k_ids), pos.append(k_pos), slots.append(k_slots), groups.append(group)
            decodes = verifies = []
        if decodes:
            d_ids, d_pos, d_slots, groups = self._decode_inputs(decodes)
            ids.append(d_ids), pos.append(d_pos), slots.append(d_slots)
        start = sum(map(len, ids))
        for first in range(0, len(verifies), DECODE_GROUP_SIZE):
            part = verifies[first:first + DECODE_GROUP_SIZE]
            v_ids, v_pos, v_slots, group = self._verify_inputs(part, start)
            ids.append(v_ids), pos.append(v_pos), slots.append(v_slots), groups.append(group)
            start += len(v_ids)
        chunks = []
        for s in prefills:
            p = np.arange(s.start, s.start + s.num_scheduled)
            table = np.asarray(s.block_ids)
            ids.append(np.asarray(s.input_token_ids()))
            pos.append(p)
            slots.append(self._slots(table, p))
            chunks.append(self._prefill_chunk(start, s, table))
            start += s.num_scheduled
        to = lambda a: torch.from_numpy(np.concatenate(a).astype(np.int64)).to(self.device)
        return to(ids), to(pos), AttentionMetadata(to(slots), groups, chunks)

    def _query_rows(self, items: list[ScheduledRequest]):
        """Each item's ``num_scheduled`` tokens from ``start``, item after item: the owning item, offset within
        it and position of every row, the items' block tables, the rows' slots and token ids."""
        counts = np.fromiter((s.num_scheduled for s in items), np.int64, len(items))
        starts = np.fromiter((s.start for s in items), np.int64, len(items))
        owner = np.repeat(np.arange(len(items)), counts)
        offset = np.arange(len(owner)) - (np.cumsum(counts) - counts)[owner]
        positions = starts[owner] + offset
        tables = self._tables(items)
        slots = tables[owner, positions // self.block_size] * self.block_size + positions % self.block_size
        token_ids = np.fromiter(chain.from_iterable(s.input_token_ids() for s in items), np.int64, len(owner))
        return owner, offset, positions, tables, slots, token_ids

    def _verify_inputs(self, verifies: list[ScheduledRequest], row_start: int):
        """Speculating requests' last token + drafts: one context gather per request, causal queries."""
        owner, offset, positions, tables, slots, token_ids = self._query_rows(verifies)
        counts = np.fromiter((s.num_scheduled for s in verifies), np.int64, len(verifies))
        starts = np.fromiter((s.start for s in verifies), np.int64, len(verifies))
        width, queries = int((starts + counts).max()), int(counts.max())
        query_pos = starts[:, None] + np.arange(queries)[None, :]  # [R, Q]
        mask = np.arange(width)[None, None, :] <= query_pos[:, :, None]
        mask[np.arange(queries)[None, :] >= counts[:, None]] = np.arange(width) == 0  # padding: see one key
        to = lambda a: torch.from_numpy(a).to(self.device)
        group = VerifyGroup(row_start, to(self._slots(tables, np.arange(width))), to(owner * queries + offset),
                            queries, to(mask[:, None]))
        return token_ids, positions, slots, group

    def _kernel_rows(self, items: list[ScheduledRequest]):
        """For the CPU kernel: one query row per token of decodes and verifications (last token + drafts),
        each over its own causal context; a verification's rows share their request's block table. The
        kernel stores every row's K/V before any row attends, so row i sees rows before it."""
        owner, _, positions, tables, slots, token_ids = self._query_rows(items)
        to = lambda a: torch.from_numpy(a).to(self.device)
        group = KernelDecodeGroup(0, to(tables[owner]), to(positions + 1), self.block_size)
        return token_ids, positions, slots, group

    @staticmethod
    def _tables(items: list[ScheduledRequest]) -> np.ndarray:
        tables = np.zeros((len(items), max(len(s.block_ids) for s in items)), dtype=np.int64)
        for row, s in zip(tables, items):
            row[:len(s.block_ids)] = s.block_ids
        return tables

    def _varlen_inputs(self, items: list[ScheduledRequest]):
        """Triton backend: each item is one causal varlen query of its ``num_scheduled`` tokens from
        ``start`` (decodes, prompt chunks and verification alike), in the same flat order as above."""
        positions, meta = triton_backend.build_metadata(items, self.block_size, self.device)
        ids = np.fromiter(chain.from_iterable(s.input_token_ids() for s in items), np.int64, len(positions))
        to = lambda a: torch.from_numpy(a).to(self.device)
        return to(ids), to(positions), meta

    def _slots(self, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return table[..., positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_inputs(self, decodes: list[ScheduledRequest]):
        """Single-token queries, batched in groups of similar context length."""
        starts = np.fromiter((s.start for s in decodes), np.int64, len(decodes))
        token_ids = np.fromiter((s.input_token_ids()[0] for s in decodes), np.int64, len(decodes))
        tables = self._tables(decodes)
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
            return PrefillChunk(query_start, s.num_scheduled, None, None)
        context_len = s.start + s.num_scheduled
        context = torch.from_numpy(self._slots(table, np.arange(context_len))).to(self.device)
        return PrefillChunk(query_start, s.num_scheduled, context,
                            causal_mask(s.num_scheduled, context_len, self.device))

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
