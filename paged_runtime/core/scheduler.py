"""The unified token-budget scheduler: no prefill or decode phases.

Every step hands out at most ``max_num_batched_tokens`` tokens across at most
``max_num_seqs`` requests so that each request's computed count catches up
with its token count. A prompt chunk, a whole prompt and a decode token are
all "compute the next N tokens of this request".

Order: running requests first, then waiting ones are admitted into whatever
budget and blocks are left (continuous batching). Both queues are kept in
policy order: arrival for "fcfs", (priority, arrival) for "priority".

``long_prefill_token_threshold`` (vLLM's; 0: off): with chunked prefill, no request
computes more than that many tokens in a step while another request runs or waits,
so a long prompt's chunks take a bounded share of the step that decoding streams
wait for. A request alone in the scheduler still gets the whole budget.

When blocks run out, the running request last in that order is preempted by
recompute: its blocks are freed (their cached prefix usually survives), its
computed count reset, and it goes back to the waiting queue. Nothing new is
admitted in a step that preempted. Thrash guard: a request resumed after a
preemption is not chosen again until it has finished its prefill, unless
nothing else can be. Under "priority", a waiting request that does not fit
preempts running requests of strictly lower priority.

Limits: no token is scheduled at or past ``max_model_len`` (a request that
reaches it finishes with "length", min_tokens or not). A request that can never
fit the KV cache (more blocks than the whole cache, checked at admission; or,
running alone, it still cannot grow) is finished with ``FINISHED_ERROR`` and
an ``error`` message instead of preempting itself forever while first-come-
first-served starves everyone behind it; ``take_failed`` hands such requests
to the core, which reports them.

Seats: a request waiting to fork holds seats for its siblings, so
``max_num_seqs`` counts running sequences plus pending forks. A group larger
than the limit (lowered live below a queued request's best_of) is admitted
when nothing else runs, and runs alone, rather than wait forever.

Parallel sampling (n / best_of): a request computes all but its last prompt
token, then forks into best_of sequences that share every block (the partial
tail too, copy-on-write). Each sequence computes the last token itself and
samples from there, so the prompt's KV is computed once.

Pooling requests (``Request.pooling``, ``--runner pooling``): prefill only. Their chunks never sample
(``ScheduledRequest.samples`` is False); one whose whole prompt is scheduled is not scheduled again, and the
output of the step that computed its last prompt token finishes it (FINISHED_STOPPED), its blocks published to
the prefix cache first. MEAN and CLS pooling skip prefix-cache hits (see ``pooling_params``).

Without chunked prefill (``chunked_prefill=False``: an encoder-only model, whose attention sees the whole
prompt at once) a waiting request is admitted only with its whole prompt; one that does not fit the step's
budget left is passed over for this step (those behind it may fit). The engine makes the budget cover
``max_model_len``, so a request first in line always fits a step of its own.

LoRA (``max_loras``): the running requests use at most ``max_loras`` distinct adapters (the base model is
none), so no step needs more adapter slots than the workers have. A waiting request whose adapter would be one
too many waits first in line: nothing behind it is admitted until a running adapter's last request finishes and
it gets in, as for blocks, so no request starves behind a stream of others'.

LongRoPE (``rope_switch``, Phi-3.5 / Phi-4-mini): the model rotates a request by one set of tables while
it is at most ``rope_switch`` tokens long and by another, throughout, once it is longer (as transformers'
generate). A request that grows past it is recomputed from scratch (like a preemption, uncounted), and a
long request's blocks are hashed with their own salt: short and long KV of the same tokens never mix.

Speculative decoding: a decoding request may also get slots for draft tokens
(``num_spec``), verified after its last token in the same step; drafts never
cost anyone a preemption. After the step, accepted drafts count as computed and
rejected ones' slots are simply written again later.

A scheduled item's tokens count as computed from the moment it is scheduled (the KV is being
written); ``update_from_output`` adds the accepted drafts. That lets the engine schedule step
N + 1 while step N still runs (asynchronous scheduling): a request whose step-N item samples is
scheduled again with that token as a placeholder (``ScheduledRequest.token_ids`` then lacks its
last token: the runner has it from step N). The step runner executes steps in order, so any KV a
step reads was written by an earlier one. Not scheduled ahead: a request verifying drafts (how
many tokens it gets is unknown) or whose pending token ends it (length, ``max_model_len``, the
LongRoPE switch). A request finished or preempted while its step ran keeps the engine's word: a
finished one's tokens are dropped, a preempted one's are appended (they are valid) and it is
recomputed later. Blocks are published to the prefix cache only up to tokens whose step has
finished. ``unschedule`` rolls back a step that never ran.
"""
from __future__ import annotations

import bisect

from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.core.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from paged_runtime.request import Request, RequestStatus
from paged_runtime.spec_decode.speculator import Speculator


def _fcfs_key(request: Request) -> tuple[int, int]:
    return (0, request.arrival)


def _priority_key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival)


SCHEDULING_POLICIES = {"fcfs": _fcfs_key, "priority": _priority_key}


def _salt_long_rope(request: Request) -> None:
    """Its blocks hash apart from a short-rotated request's with the same tokens (rehashed from scratch)."""
    request.cache_salt = f"{request.cache_salt or ''}\0long rope"
    request.block_hashes.clear()


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", speculator: Speculator | None = None, max_model_len: int | None = None,
                 rope_switch: int | None = None, chunked_prefill: bool = True, max_loras: int | None = None,
                 long_prefill_token_threshold: int = 0) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {sorted(SCHEDULING_POLICIES)}, got {policy!r}")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self._key = SCHEDULING_POLICIES[policy]
        self.waiting: list[Request] = []  # sorted by the policy's key
        self.running: list[Request] = []  # sorted by the policy's key
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_req_ids: list[str] = []
        self._known_to_runner: set[str] = set()  # requests the runner holds state for
        self.speculator = speculator
        self.max_model_len = max_model_len  # None: no limit of its own (unit tests)
        self._failed: list[Request] = []  # finished with FINISHED_ERROR since the last take_failed
        self.rope_switch = rope_switch  # the model's LongRoPE switch length (None: it has none)
        self._in_flight: dict[str, ScheduledRequest] = {}  # items scheduled whose output is not in yet
        self.chunked_prefill = chunked_prefill  # False: a prompt is admitted whole or not at all
        self.long_prefill_token_threshold = long_prefill_token_threshold if chunked_prefill else 0
        self.max_loras = max_loras  # most distinct adapters among the running requests (None: LoRA is off)

    # ---- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self.rope_switch is not None and request.num_tokens > self.rope_switch:
            _salt_long_rope(request)
        bisect.insort(self.waiting, request, key=self._key)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (stop or abort) requests wherever they are; unknown ids are ignored."""
        finished = [self.requests[rid] for rid in request_ids if rid in self.requests]
        for request in finished:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._release(request, status)
        return finished

    def take_failed(self) -> list[Request]:
        """Requests finished with ``FINISHED_ERROR`` (``request.error`` says why) since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_seats(self) -> int:
        """Sequences running plus the siblings their pending forks will add (what ``max_num_seqs`` bounds)."""
        return len(self.running) + sum(r.num_pending_forks for r in self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preemptions = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.paused or (request.pooling is not None and request.num_computed_tokens >= request.num_tokens):
                index += 1  # a pooling request whose prompt is all scheduled waits for that step's output
                continue
            pending = self._num_pending(request)
            if pending is None:  # its next tokens depend on the output of the step in flight
                index += 1
                continue
            if request.num_pending_forks and request.num_uncomputed_tokens == 1:
                self._fork(request)
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget, pending)
            drafts = self._drafts(request, num_new, budget)
            while not self.kv_cache.allocate_slots(request, num_new + len(drafts)):
                if drafts:  # speculation is optional: drop it before preempting anyone
                    drafts = []
                    continue
                if self.running == [request]:  # the whole cache is its own and it still cannot grow
                    self.running.remove(request)
                    self._fail(request, f"the request outgrew the KV cache: {request.num_tokens} tokens need more "
                                        f"than its {self.kv_cache.pool.num_blocks} blocks")
                    break
                victim = self._pick_victim()
                refund = self._preempt(victim, scheduled)
                budget += refund
                index -= refund > 0
                if victim is request:
                    break
            else:
                scheduled.append(self._schedule(request, num_new, drafts))
                budget -= num_new + len(drafts)
                index += 1
        num_preempted = self.num_preemptions - num_preemptions
        if num_preempted == 0:
            self._admit_waiting(budget, scheduled)
        for item in scheduled:  # only now: an item can be preempted away within the step
            self._describe_for_runner(item)
            self.requests[item.request_id].num_computed_tokens += item.num_new_tokens
            self._in_flight[item.request_id] = item
        out = SchedulerOutput(scheduled, sum(s.num_scheduled for s in scheduled), num_preempted,
                              self.kv_cache.take_pending_copies(), self._finished_req_ids)
        self._finished_req_ids = []
        return out

    def _num_pending(self, request: Request) -> int | None:
        """Tokens ``request`` is still being sampled by the step in flight: 0 or 1; None when its next
        step must wait for that output (drafts under verification, a pending token that ends it, a fork)."""
        item = self._in_flight.get(request.request_id)
        if item is None:
            return 0
        if request.num_pending_forks and request.num_uncomputed_tokens == 1:
            return None  # its siblings fork once the blocks they share are written and published
        if not item.samples:
            return 0
        num_tokens = request.num_tokens + 1
        if item.num_spec or request.num_output_tokens + 1 >= request.max_tokens:
            return None
        if self.max_model_len is not None and num_tokens >= self.max_model_len:
            return None
        if self.rope_switch is not None and num_tokens - 1 <= self.rope_switch < num_tokens:
            return None
        return 1

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int, pending: int = 0) -> int:
        wanted = self._num_wanted(request, num_computed, pending)
        if self.long_prefill_token_threshold and len(self.running) + len(self.waiting) > 1:  # not alone
            wanted = min(wanted, self.long_prefill_token_threshold)
        return min(wanted, budget)

    @staticmethod
    def _num_wanted(request: Request, num_computed: int, pending: int = 0) -> int:
        """The tokens ``request`` would compute next with no budget to stop it."""
        num_new = request.num_tokens + pending - num_computed
        if request.num_pending_forks:
            num_new -= 1  # stop before the last prompt token: that is where the siblings fork
        return num_new

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        position = 0  # paused requests (beam search) are skipped, not waited for
        seats = self.num_seats
        while position < len(self.waiting) and budget > 0:
            request = self.waiting[position]
            if request.paused:
                position += 1
                continue
            error = self._never_fits(request)
            if error is not None:
                self._fail(self.waiting.pop(position), error)
                continue
            if seats and seats + 1 + request.num_pending_forks > self.max_num_seqs:
                break  # an oversized group (seats == 0) goes in alone rather than never
            if self._needs_adapter_slot(request):
                break  # it waits, first in line, for a running adapter to finish: no later request passes it
            computed, num_computed = self.kv_cache.get_computed_blocks(request)
            if not self.chunked_prefill and self._num_wanted(request, num_computed) > budget:
                position += 1  # its whole prompt does not fit what is left of this step
                continue
            num_new = self._num_new_tokens(request, num_computed, budget)
            if not self.kv_cache.allocate_slots(request, num_new, computed):
                if self._preempt_for_priority(request, scheduled):
                    budget = self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
                    seats = self.num_seats
                    continue  # rare: recount the budget the victim may have given back
                if not self.running:  # every block is free and it still does not fit: it never will
                    self._fail(self.waiting.pop(position), "the request does not fit in the whole KV cache")
                    continue
                break
            seats += 1 + request.num_pending_forks
            self.kv_cache.record_prefix_query(request, num_computed)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.waiting.pop(position)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._key)
            if num_new:  # 0 when the fork point is right at admission: it forks next step
                scheduled.append(self._schedule(request, num_new))
            budget -= num_new

    def running_adapters(self) -> set[int]:
        return {r.lora_id for r in self.running if r.lora_id}

    def _needs_adapter_slot(self, request: Request) -> bool:
        """``request``'s adapter is not running and ``max_loras`` already are (a step never holds more)."""
        if not request.lora_id or self.max_loras is None:
            return False
        running = self.running_adapters()
        return request.lora_id not in running and len(running) >= self.max_loras

    def _never_fits(self, request: Request) -> str | None:
        """Why ``request`` could never run (its tokens alone exceed the context or the whole cache), or None."""
        if self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            return f"the request has {request.num_tokens} tokens, max_model_len is {self.max_model_len}"
        num_blocks = self.kv_cache.num_blocks_needed(request.num_tokens, self.max_num_batched_tokens)
        if num_blocks > self.kv_cache.pool.num_blocks:
            return (f"the request's {request.num_tokens} tokens need {num_blocks} blocks; the whole KV cache has "
                    f"{self.kv_cache.pool.num_blocks}")
        return None

    def _preempt_for_priority(self, request: Request, scheduled: list[ScheduledRequest]) -> bool:
        """Under "priority", free a strictly lower-priority runner for ``request``; False if none."""
        if self.policy != "priority" or not self.running:
            return False
        victim = self._pick_victim()
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, scheduled)
        return True

    def _schedule(self, request: Request, num_new: int, drafts: list[int | None] = ()) -> ScheduledRequest:
        """``drafts``: known draft tokens, or None placeholders for the runner's draft model."""
        known = [] if None in drafts else list(drafts)
        start = request.num_computed_tokens
        # A pending token (async scheduling) is past all_token_ids: the slice leaves it out, and it samples.
        samples = start + num_new >= request.num_tokens and request.pooling is None
        return ScheduledRequest(request.request_id, start, num_new, request.all_token_ids[start:start + num_new],
                                samples, len(drafts), known)

    def _describe_for_runner(self, item: ScheduledRequest) -> None:
        """What the runner lacks: the request's whole data the first time, then its block-table changes."""
        request = self.requests[item.request_id]
        item.block_ids_update = self.kv_cache.take_block_ids_update(item.request_id)
        if item.request_id not in self._known_to_runner:
            self._known_to_runner.add(item.request_id)
            item.new_request = NewRequestData(request.request_id, list(request.all_token_ids),
                                              request.num_prompt_tokens, request.params, request.index,
                                              request.eos_token_ids, request.pooling, request.lora_request)

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int | None]:
        """Draft tokens to verify after a decoding request's last token (none when not speculating)."""
        if self.speculator is None or request.pooling is not None or num_new != 1 or request.num_uncomputed_tokens != 1:
            return []
        limit = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - request.num_tokens - 1)
        if self.rope_switch is not None and request.num_tokens <= self.rope_switch:
            limit = min(limit, self.rope_switch - request.num_tokens)  # nothing sampled past the switch short
        return self.speculator.propose(request, limit)

    def fork_request(self, parent: Request, request_id: str) -> Request:
        """A new sequence continuing ``parent`` (beam search), sharing its blocks."""
        child = parent.fork(parent.index, request_id)
        self.requests[request_id] = child
        if parent.status == RequestStatus.RUNNING:
            self.kv_cache.fork(parent, child)
            bisect.insort(self.running, child, key=self._key)
        else:
            child.num_computed_tokens = 0
            bisect.insort(self.waiting, child, key=self._key)
        return child

    def _fork(self, parent: Request) -> None:
        for index in range(1, parent.num_pending_forks + 1):
            child = parent.fork(index)
            self.kv_cache.fork(parent, child)
            self.requests[child.request_id] = child
            bisect.insort(self.running, child, key=self._key)
        parent.num_pending_forks = 0

    def _pick_victim(self) -> Request:
        """The last running request in policy order, skipping resumed ones still in prefill."""
        for request in reversed(self.running):
            if not (request.num_preemptions and request.num_computed_tokens < request.num_tokens):
                return request
        return self.running[-1]

    def _preempt(self, request: Request, scheduled: list[ScheduledRequest]) -> int:
        """Preempt by recompute; returns the tokens it had been scheduled this step (0 if none)."""
        self._requeue(request)
        was_scheduled = [s for s in scheduled if s.request_id == request.request_id]
        for item in was_scheduled:
            scheduled.remove(item)
        request.num_preemptions += 1
        self.num_preemptions += 1
        return sum(s.num_new_tokens for s in was_scheduled)

    def _requeue(self, request: Request) -> None:
        """Back to waiting with no KV: it will be recomputed from its first token."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._key)

    # ---- after the forward pass ---------------------------------------------
    def update_from_output(self, output: SchedulerOutput,
                           sampled: list[list[int]]) -> list[tuple[Request | None, list[int]]]:
        """Append sampled tokens, count accepted drafts as computed, finish stopped requests.

        ``sampled[i]`` holds item i's new tokens: none for a prompt chunk that did not
        reach the end, one for a plain decode, accepted drafts + one for speculation
        (the accepted drafts' KV was computed; rejected ones' slots are simply rewritten
        later). Returns each item's request and the tokens it actually appended: a stop cuts the rest;
        (None, []) for a request that finished while the step ran.
        """
        appended = []
        for item, tokens in zip(output.scheduled, sampled):
            if self._in_flight.get(item.request_id) is item:
                del self._in_flight[item.request_id]
            request = self.requests.get(item.request_id)
            if request is None:
                appended.append((None, []))
                continue
            kept, status = self._append(request, tokens)
            appended.append((request, kept))
            running = request.status == RequestStatus.RUNNING  # else preempted after this step was scheduled
            if running:
                # After a stop inside the accepted drafts, KV past the last kept token is dropped.
                request.num_computed_tokens = min(request.num_computed_tokens + max(0, len(tokens) - 1),
                                                  request.num_tokens)
                self.kv_cache.cache_computed_blocks(request, self._num_finished_tokens(request))
                if request.pooling is not None and item.start + item.num_new_tokens >= request.num_prompt_tokens:
                    status = RequestStatus.FINISHED_STOPPED  # its prompt is computed: the runner pooled it
            if status is not None:
                (self.running if running else self.waiting).remove(request)
                self._release(request, status)
            elif self._crossed_rope_switch(request, len(kept)):
                self._recompute_long(request)
        return appended

    def _append(self, request: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        kept = []
        for token_id in tokens:
            request.append_token(token_id)
            kept.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                return kept, status
        return kept, None

    def _num_finished_tokens(self, request: Request) -> int:
        """Computed tokens whose step has finished: the blocks that may be published."""
        item = self._in_flight.get(request.request_id)
        return request.num_computed_tokens - (item.num_new_tokens if item is not None else 0)

    def unschedule(self, output: SchedulerOutput, resend: bool) -> None:
        """Roll back a step that never ran: its live requests' computed counts; with ``resend``, also what it
        told the runner (new requests, block-table changes, block copies, finished ids) is told again."""
        for item in output.scheduled:
            if self._in_flight.get(item.request_id) is item:
                del self._in_flight[item.request_id]
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens -= item.num_new_tokens
            if resend and item.new_request is not None:
                self._known_to_runner.discard(item.request_id)
            if resend and item.block_ids_update is not None:
                self.kv_cache.mark_changed(item.request_id, item.block_ids_update[0])
        if resend:
            self._finished_req_ids[:0] = output.finished_req_ids
            self.kv_cache.restore_pending_copies(output.block_copies)

    def _crossed_rope_switch(self, request: Request, num_appended: int) -> bool:
        switch = self.rope_switch
        return switch is not None and request.num_tokens - num_appended <= switch < request.num_tokens

    def _recompute_long(self, request: Request) -> None:
        """``request`` just grew past ``rope_switch``: its KV, rotated short, is recomputed long from scratch."""
        _salt_long_rope(request)
        if request.status == RequestStatus.RUNNING:  # a preempted one is recomputed anyway
            self._requeue(request)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        at_limit = self.max_model_len is not None and request.num_tokens >= self.max_model_len
        if request.num_output_tokens < params.min_tokens:
            # EOS and stop tokens were masked by the sampler until here; the context ends it regardless.
            return RequestStatus.FINISHED_LENGTH if at_limit else None
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or at_limit:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fail(self, request: Request, error: str) -> None:
        """Finish a request (already out of the queues) with FINISHED_ERROR; its blocks go back at once."""
        request.error = error
        self._release(request, RequestStatus.FINISHED_ERROR)
        self._failed.append(request)

    def _release(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._known_to_runner.discard(request.request_id)
        self._finished_req_ids.append(request.request_id)

    def check_invariants(self) -> None:
        self.kv_cache.check_invariants(self.running + list(self.waiting))
        # Above the limit only as one group admitted alone (the limit was lowered below its size).
        assert self.num_seats <= self.max_num_seqs or len({r.group_id for r in self.running}) == 1
        if not self.requests:
            assert self.kv_cache.num_free_blocks == self.kv_cache.pool.num_blocks, "idle engine holds blocks"
