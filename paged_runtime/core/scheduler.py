"""The unified token-budget scheduler: no prefill or decode phases.

Every step hands out at most ``max_num_batched_tokens`` tokens across at most
``max_num_seqs`` requests so that each request's computed count catches up
with its token count. A prompt chunk, a whole prompt and a decode token are
all "compute the next N tokens of this request".

Order: running requests first (in priority-then-arrival order), then waiting
ones are admitted into whatever budget and blocks are left (continuous
batching). When blocks run out, the lowest-priority, latest-arrived running
request is preempted by recompute: its blocks are freed, its computed count
reset, and it goes back to the head of the queue. Nothing new is admitted in
a step that preempted. Because victims are always taken from the back of the
arrival order, the earliest request always makes progress (no livelock), and
a resumed request is only chosen again after every later arrival.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (num_computed_tokens at schedule time)
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits are sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    num_preempted: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy before the forward
    # Requests that left the engine since the last step: the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


def _order_key(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by (priority, arrival)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_req_ids: list[str] = []

    # ---- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_uncomputed_tokens, budget)
            allocated, preempted = self._allocate_or_preempt(request, num_new)
            num_preempted += preempted
            if not allocated:
                break  # the request itself was the last one and got preempted
            scheduled.append(self._schedule(request, num_new))
            budget -= num_new
            index += 1
        if num_preempted == 0:
            budget = self._admit_waiting(budget, scheduled)
        out = SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, num_preempted,
                              self.kv_cache.take_pending_copies(), self._finished_req_ids)
        self._finished_req_ids = []
        return out

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - len(hits) * self.kv_cache.block_size, budget)
            if not self.kv_cache.allocate_slots(request, num_new, hits):
                break
            self.kv_cache.record_prefix_query(request, len(hits))
            request.num_computed_tokens = len(hits) * self.kv_cache.block_size
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_order_key)
            scheduled.append(self._schedule(request, num_new))
            budget -= num_new
        return budget

    def _schedule(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(request, request.num_computed_tokens, num_new,
                                self.kv_cache.block_ids(request.request_id))

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[bool, int]:
        """Allocate slots for ``request``, preempting from the back until it fits."""
        num_preempted = 0
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            num_preempted += 1
            if victim is request:
                return False, num_preempted
        return True, num_preempted

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the forward pass ---------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: list[int | None]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish stopped requests.

        Returns the requests that got a new token this step (finished ones included).
        """
        updated = []
        for item, token_id in zip(output.scheduled, sampled_token_ids):
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_computed_blocks(request)
            if token_id is None:
                continue
            request.append_token(token_id)
            updated.append(request)
            status = self._stop_status(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._release(request, status)
        return updated

    @staticmethod
    def _stop_status(request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _release(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)

    def check_invariants(self) -> None:
        self.kv_cache.check_invariants(self.running + list(self.waiting))
        assert len(self.running) <= self.max_num_seqs
        if not self.requests:
            assert self.kv_cache.num_free_blocks == self.kv_cache.pool.num_blocks, "idle engine holds blocks"
