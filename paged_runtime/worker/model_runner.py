"""Executes a scheduled step: flat batch in, new tokens out.

The runner never decides who runs. It keeps its own state of every request
(``request_states``: token history, block table, sampling parameters, generator)
up to date from what the scheduler sends, lays the step out as one batch
(``paged_runtime.batch``) for the selected attention backend, runs the model,
computes logits only where a token is sampled (never for a pooling request's chunks: ``pooler`` pools
their hidden rows instead), and samples: one token per chunk
that reaches its request's end, or, for a speculating request, the drafts the
rejection sampler accepts plus one (a draft model, when configured, proposes them
first in the same step). Inputs are built with numpy over whole arrays, not per token.

A step that raises leaves nothing the next step could trip on, once the caller drops the
failed requests (``retain``): the only request-specific work before the forward pass (setting
up a request's state, writing its tokens and block table) is done for every request, and a
request it fails for is named by ``RequestSetupError``; the others' state is then exactly what
the scheduler sent, so they can simply be scheduled again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_runtime.attention import BUILDERS
from paged_runtime.batch import BatchItem, StepItem, build_batch, layout_order
from paged_runtime.core.scheduler_output import ScheduledRequest, SchedulerOutput
from paged_runtime.kernels import kv_quant
from paged_runtime.layers.attention import attention_layers, bind_kv_caches
from paged_runtime.worker.sampling_metadata import build_sampling_metadata
from paged_runtime.sample.sampler import Sampler, SamplerOutput, apply_token_bitmask
from paged_runtime.spec_decode.draft_model import DraftModelProposer
from paged_runtime.spec_decode.rejection_sampler import RejectionSampler, SpecRow
from paged_runtime.worker.grammar_masks import GrammarMaskFiller, GrammarMasks
from paged_runtime.worker.pooler import pool_items
from paged_runtime.utils.cpu import huge_page_zeros, keep_freed_memory_mapped
from paged_runtime.worker.cpu_decode_plan import CpuDecodePlan
from paged_runtime.worker.cuda_graphs import DecodeGraphs
from paged_runtime.utils.device_inputs import to_device, to_host
from paged_runtime.worker.request_states import CachedRequest, RequestStates


@dataclass(slots=True)
class TokenLogprobs:
    """Raw logprob and rank of one token, and the top-k alternatives at its position."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class ScoredRows:
    """Hidden rows a step scores, by use: sampled rows, each verification's span, item -> prompt chunk rows."""
    sample: np.ndarray
    verify: list[np.ndarray]
    prompt: dict[int, np.ndarray]


class RequestSetupError(Exception):
    """Setting up these requests' state for a step failed (e.g. a seed out of range); nothing ran.

    Their partial state is already dropped; every other scheduled request's state is complete."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"could not set up requests {request_ids}")
        self.request_ids = request_ids

    def __reduce__(self):  # crosses from a worker process intact
        return RequestSetupError, (self.request_ids,)


@dataclass(slots=True)
class RunnerOutput:
    """Per scheduled request, in the scheduler's order."""
    # Empty: a prompt chunk that did not reach the end; one token for a plain decode;
    # accepted drafts + one for a speculating request.
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]  # one entry per token, when the request asks
    # (first prompt position scored, entries): entry i scores prompt token first + i + 1.
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None]
    # A pooling request's vector, in the step that computes its last prompt token (``worker/pooler.py``).
    pooled: list[list[float] | None] | None = None


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Entry i: token_ids[i]'s logprob and rank in row i of ``logprobs``, and the row's top ``num_top``."""
    targets = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    top_ids = top.indices.tolist() if top else [[] for _ in ranks]
    top_lps = top.values.tolist() if top else [[] for _ in ranks]
    return [TokenLogprobs(t, lp, r, i, v) for t, lp, r, i, v in zip(token_ids, chosen.tolist(), ranks, top_ids, top_lps)]


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 seed: int, attention_backend: str, max_blocks_per_request: int,
                 drafter: DraftModelProposer | None = None, graphs: tuple[int, int] | None = None,
                 samples: bool = True, kv_cache_dtype: str = "auto", lora=None) -> None:
        """``graphs``: (max_num_seqs, max_model_len) to capture CUDA graphs for decode steps (Triton backend
        on CUDA only; see ``cuda_graphs``); None runs every step eagerly. ``samples``: False on a rank of a
        parallel model that only computes its share of the forward pass (``execute`` returns None there:
        one rank samples, and the others learn the tokens from the scheduler's next step).
        ``kv_cache_dtype``: auto (the model's dtype), bfloat16, fp8 / fp8_e4m3 or int8 (``kernels.kv_quant``).
        ``lora``: the model's adapter slots (``lora/slots.LoRASlots``), or None: LoRA is off."""
        c = model.config
        self.model, self.block_size, self.device = model, block_size, device
        self.attention_backend = attention_backend
        self.build_metadata = BUILDERS[attention_backend]
        if device.type == "cpu":
            keep_freed_memory_mapped()
        self.kv_caches = allocate_kv_caches(model, num_blocks * block_size, dtype, device, kv_cache_dtype)
        self.samples = samples
        self.states = RequestStates(max_blocks_per_request, c.vocab_size, device, samples=samples)
        self.grammar_masks = GrammarMaskFiller(c.vocab_size)
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.drafter = drafter
        self.lora = lora
        self.graphs = None
        if graphs is not None and attention_backend == "triton":
            self.graphs = DecodeGraphs(model, block_size, *graphs, device, lora_step=lora.step if lora else None)
            self.graphs.capture_all()
        # The compiled CPU decode step of each model this runner runs (the drafter's too), over its bound caches.
        self.cpu_plans = {} if attention_backend != "cpu" else {
            m: CpuDecodePlan.build(m, dtype) for m in (model, drafter.model if drafter else None) if m is not None}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput | None:
        for request_id in out.finished_req_ids:
            self.states.remove(request_id)
            if self.drafter is not None:
                self.drafter.forget(request_id)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        steps = self._step_items(out.scheduled)
        # Decodes, then verifications, then prompt chunks; shortest context first within each.
        order = layout_order(steps)
        items = [steps[i] for i in order]
        if not self.samples:  # this rank's share of the forward pass (and of the LM-head product) only
            hidden, ends = self._run(items)
            if hidden is not None:  # None on a pipeline stage before the last
                self._logits(hidden, self._scored_rows(items, ends))
            return None
        spec_rows = {k: self._spec_row(s) for k, s in enumerate(items) if s.num_spec}
        if self.drafter is not None:
            self.drafter.propose(items, spec_rows, self.forward, self.sampler.generator)
            for k, row in spec_rows.items():
                items[k].spec_token_ids = row.drafts
        sampling = [k for k, s in enumerate(items) if s.samples and not s.num_spec]
        requests = [self.states[items[k].request_id] for k in sampling]
        filling = self.grammar_masks.start(requests, [(self.states[items[k].request_id], row.drafts)
                                                      for k, row in spec_rows.items()])
        hidden, ends = self._run(items)  # the masks fill meanwhile
        pooled = pool_items(items, self.states, hidden, ends) if self.states.has_pooling else None
        scored = self._scored_rows(items, ends)
        sample_logits, verify_logits, prompt_logits = self._logits(hidden, scored)
        masks = filling.result() if filling is not None else None
        result = RunnerOutput([[] for _ in items], [None] * len(items), [None] * len(items))
        if sampling:
            meta = build_sampling_metadata(requests, self.states)
            if masks is not None and masks.sample_rows:
                meta.grammar_bitmask = (masks.sample_rows, masks.sample)
            sampled = self.sampler(sample_logits, meta)
            self._store_samples(result, sampling, requests, sampled)
        if spec_rows:
            self._verify(items, spec_rows, verify_logits, result, masks)
        for k, s in enumerate(items):
            state = self.states[s.request_id]
            state.write_tokens(s.start + s.num_new_tokens, result.token_ids[k])
            if k in prompt_logits:
                result.prompt_logprobs[k] = self._prompt_logprobs(s, state, prompt_logits[k])
        back = np.argsort(order)  # from the runner's order back to the scheduler's
        output = RunnerOutput(*([field[k] for k in back]
                                for field in (result.token_ids, result.logprobs, result.prompt_logprobs)))
        if pooled:
            output.pooled = [pooled.get(k) for k in back]
        return output

    def _scored_rows(self, items: list[StepItem], ends: np.ndarray) -> ScoredRows:
        """The hidden rows this step turns into logits: the last row of each sampling item, each
        verification's span (its last token and its drafts), each prompt-logprobs chunk's rows (scoring prompt
        tokens start + 1 .. the chunk's end or the prompt's last)."""
        sample = np.array([ends[k] - 1 for k, s in enumerate(items) if s.samples and not s.num_spec], np.int64)
        verify = [np.arange(ends[k] - s.num_spec - 1, ends[k]) for k, s in enumerate(items) if s.num_spec]
        prompt = {}
        for k, s in enumerate(items):
            state = self.states[s.request_id]
            if state.params.prompt_logprobs is not None and s.start < state.num_prompt_tokens - 1:
                end = min(s.start + s.num_new_tokens, state.num_prompt_tokens - 1)
                prompt[k] = np.arange(end - s.start) + ends[k] - s.num_scheduled
        return ScoredRows(sample, verify, prompt)

    def _logits(self, hidden: torch.Tensor, scored: ScoredRows):
        """(sampled rows' logits, the verifications' logits, {item: its prompt chunk's logits}) from one
        LM-head product, which on a tensor-parallel model every rank of the last stage joins (the head's
        vocabulary shards are gathered)."""
        parts = [scored.sample, *scored.verify, *scored.prompt.values()]
        sizes = [len(p) for p in parts]
        if not sum(sizes):
            return None, None, {}
        rows, = to_device(self.device, np.concatenate(parts))
        logits = self.model.compute_logits(hidden[rows])
        sample, rest = logits[:sizes[0]], logits[sizes[0]:]
        num_verify = sum(sizes[1:1 + len(scored.verify)])
        chunks = rest[num_verify:].split(sizes[1 + len(scored.verify):])
        return sample, rest[:num_verify], dict(zip(scored.prompt, chunks))

    def forward(self, model, items: list[BatchItem]) -> torch.Tensor:
        """``model``'s hidden states for ``items`` (in ``layout_order``) over its bound caches."""
        batch = build_batch(items, self.states.block_tables, self.block_size)
        meta = self.build_metadata(batch, self.device)
        input_ids, positions = to_device(self.device, batch.token_ids, self._rope_positions(model, items, batch))
        hidden = self.graphs.run(input_ids, positions, meta) if self.graphs is not None and model is self.model else None
        if hidden is not None:
            return hidden
        plan = self.cpu_plans.get(model)
        return model(input_ids, positions, meta, plan.decoder(meta) if plan is not None else None)

    def _rope_positions(self, model, items: list[BatchItem], batch) -> np.ndarray:
        """The positions ``model`` takes (rows of its rotary tables): the tokens' own, shifted per request by
        ``model.rope_position_offset`` of its length so far (LongRoPE's long half; other models: no shift)."""
        if model.rope_switch is None:
            return batch.positions
        lengths = {state.row: len(state.token_ids) for state in self.states.requests.values()}
        offsets = model.rope_position_offset(np.array([lengths[s.table_row] for s in items], np.int64))
        return batch.positions + offsets[batch.row_owner]

    def _run(self, items: list[StepItem]) -> tuple[torch.Tensor, np.ndarray]:
        """The target's hidden states for the step, and each item's end row in them."""
        counts = [s.num_scheduled for s in items]
        if self.lora is not None:  # each row runs its request's adapter (the drafter's model has none)
            self.lora.prepare(np.repeat([self.states[s.request_id].lora_id for s in items], counts))
        hidden = self.forward(self.model, [s.batch_item() for s in items])
        return hidden, np.cumsum(counts)

    # ---- request state -----------------------------------------------------------
    def _step_items(self, scheduled: list[ScheduledRequest]) -> list[StepItem]:
        """Every request's item; raises ``RequestSetupError`` naming those that could not be set up."""
        steps, failed, error = [], [], None
        for s in scheduled:
            try:
                steps.append(self._step_item(s))
            except Exception as e:  # one request's parameters: the others' state must still be complete
                failed.append(s.request_id)
                error = e
        if failed:
            self.retain(set(self.states.requests) - set(failed))
            raise RequestSetupError(failed) from error
        return steps

    def retain(self, request_ids) -> None:
        """Drop the state of every request not in ``request_ids`` (after a failed step)."""
        for request_id in self.states.retain(request_ids):
            if self.drafter is not None:
                self.drafter.forget(request_id)

    def check_invariants(self, request_ids) -> None:
        """The runner holds state only for ``request_ids`` (the live requests), in rows that add up."""
        self.states.check_invariants()
        unknown = set(self.states.requests) - set(request_ids)
        assert not unknown, f"the runner holds state for requests that left: {sorted(unknown)}"
        if self.drafter is not None:
            assert set(self.drafter.computed) <= set(request_ids), "the drafter holds state for requests that left"

    def _step_item(self, s: ScheduledRequest) -> StepItem:
        """Bring the runner's state of ``s``'s request up to date; its item for this step."""
        if s.new_request is not None and s.new_request.lora_request is not None:
            self._know_adapter(s.new_request.lora_request)
        state = self.states.add(s.new_request) if s.new_request is not None else self.states[s.request_id]
        if s.block_ids_update is not None:
            self.states.update_blocks(state, *s.block_ids_update)
        state.write_tokens(s.start, s.token_ids)
        # With asynchronous scheduling the item's last token can be one this runner sampled in the step before.
        if len(state.token_ids) < s.start + s.num_new_tokens:
            raise RuntimeError(f"{s.request_id}: tokens up to {s.start + s.num_new_tokens} scheduled, "
                               f"{len(state.token_ids)} known")
        return StepItem(s.request_id, state.token_ids, state.row, s.start, s.num_new_tokens, list(s.spec_token_ids),
                        s.num_spec, s.samples)

    def _know_adapter(self, lora_request) -> None:
        """A new request's adapter, read here if the engine's ``add_lora`` did not reach this worker first."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine")
        if lora_request.lora_int_id not in self.lora.requests:
            self.lora.add(lora_request)

    def _spec_row(self, s: StepItem) -> SpecRow:
        state = self.states[s.request_id]
        p = state.params
        return SpecRow(0, list(s.spec_token_ids), None, p.temperature, p.top_k, p.top_p, p.min_p, state.generator)

    def _verify(self, items: list[StepItem], spec_rows: dict[int, SpecRow], logits: torch.Tensor,
                result: RunnerOutput, masks: GrammarMasks | None) -> None:
        """Score each speculating request's last token and drafts (``logits``: their spans, in order); keep
        what the rejection sampler accepts. A constrained request's positions are masked first, so a draft its
        grammar refuses is rejected."""
        first = 0
        for k, row in spec_rows.items():
            row.first_row, first = first, first + items[k].num_spec + 1
        if masks is not None and masks.spec_rows:
            logits = logits.float()
            apply_token_bitmask(logits, masks.spec_rows, masks.spec)
        emitted = self.rejection_sampler(logits, list(spec_rows.values()))
        for (k, row), tokens in zip(spec_rows.items(), emitted):
            result.token_ids[k] = tokens
            if self.drafter is not None:
                self.drafter.accepted(items[k], len(tokens) - 1)
            params = self.states[items[k].request_id].params
            if params.needs_logprobs:
                scored = logits[row.first_row:row.first_row + len(tokens)].log_softmax(dim=-1)
                result.logprobs[k] = token_logprobs(scored, tokens, params.logprobs or 0)

    @staticmethod
    def _store_samples(result: RunnerOutput, positions: list[int], requests: list[CachedRequest],
                       sampled: SamplerOutput) -> None:
        # One device read for the step: the tokens and any logprobs come back together.
        fields = (sampled.token_ids, sampled.logprobs, sampled.ranks, sampled.top_ids, sampled.top_logprobs)
        present = [f for f in fields if f is not None]
        back = iter(t.tolist() for t in to_host(*present))
        tokens, logprobs, ranks, top_ids, top_lps = (next(back) if f is not None else None for f in fields)
        for j, (k, request) in enumerate(zip(positions, requests)):
            result.token_ids[k] = [tokens[j]]
            if sampled.logprobs is not None and request.params.needs_logprobs:
                num = request.params.logprobs or 0
                result.logprobs[k] = [TokenLogprobs(tokens[j], logprobs[j], ranks[j],
                                                    top_ids[j][:num] if num else [], top_lps[j][:num] if num else [])]

    def _prompt_logprobs(self, s: StepItem, state: CachedRequest,
                         logits: torch.Tensor) -> tuple[int, list[TokenLogprobs]]:
        """Score prompt tokens start+1 .. start+len(logits) from this chunk's logits."""
        targets = state.token_ids[s.start + 1:s.start + 1 + len(logits)]
        return s.start, token_logprobs(logits.log_softmax(dim=-1), targets, state.params.prompt_logprobs)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each (src, dst) pair's dst block the KV of src, in every layer (an int8 cache's
        scales too: they are among ``kv_caches``)."""
        offsets = np.arange(self.block_size)
        src, dst = (torch.from_numpy((np.asarray(b)[:, None] * self.block_size + offsets).ravel()).to(self.device)
                    for b in zip(*copies))
        kv_quant.copy_slots(self.kv_caches, src, dst)
        if self.drafter is not None:
            self.drafter.copy_slots(src, dst)


def allocate_kv_caches(model, num_slots: int, dtype: torch.dtype, device: torch.device,
                       kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """One zeroed ``[num_slots, 2, num_kv_heads, head_dim]`` cache per attention layer this rank holds (its
    KV heads), in ``dtype`` or ``kv_cache_dtype`` (an 8-bit one with its scales: ``kernels.kv_quant``), bound to
    those layers. Zeroed, not empty: masked-out context slots are still multiplied by 0 in attention.
    Returns every tensor indexed by slot (the caches, then int8's ``[num_slots, 2, num_kv_heads]`` scales):
    what copy-on-write copies. Allocated once: CUDA graphs capture these very tensors."""
    cache_dtype = kv_quant.cache_dtype(kv_cache_dtype, dtype)

    def zeros(shape):
        if device.type != "cpu":
            return torch.zeros(shape, dtype=cache_dtype, device=device)
        try:
            return huge_page_zeros(shape, cache_dtype)
        except MemoryError as e:
            raise MemoryError(f"the KV cache ({num_slots} slots a layer) does not fit in this machine's memory: "
                              f"{e}; give it less (kv_cache_memory)") from e
    kv_caches = [zeros((num_slots, 2, layer.num_kv_heads, layer.head_dim)) for layer in attention_layers(model)]
    kv_scales = [kv_quant.allocate_scale(kv_cache) for kv_cache in kv_caches]
    bind_kv_caches(model, kv_caches, kv_scales)
    return kv_caches + [s for s in kv_scales if s is not None and s.dim() > 1]
