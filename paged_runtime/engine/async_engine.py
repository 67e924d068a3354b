"""The asynchronous engine: the step loop on its own thread, outputs through per-request asyncio queues.

``AsyncEngine`` implements ``EngineClient`` (``client.py``), the API every front end uses; it reaches
its ``LLMEngine`` only through that engine's declared methods (``step``, ``stats``, ``reconfigure``, ...).

Threading contract
    ``LLMEngine`` is not thread-safe, so only the step-loop thread touches it
    (build, add, abort, step). Callers, from any event loop, hand work over through
    an inbox guarded by one condition variable; outputs come back through the
    caller's own ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. The
    loop thread sleeps on the condition whenever the engine has nothing to do,
    so an idle server burns no CPU and an event loop never waits on a step.

    Callers tokenize on their side with a private copy of the tokenizer
    (``self.tokenizer`` / ``self.process``): a Hugging Face fast tokenizer
    must not be used from two threads at once, and the loop thread uses the
    engine's own copy for detokenization.

Failure contract
    A client's mistake raises ``ValueError`` from ``add_request`` and never
    reaches the loop. A full waiting queue raises ``EngineOverloadedError``.
    A request the engine fails alone (a step it was in raised; ``RequestOutput.error``)
    ends its stream with ``RequestFailedError``; the others go on. Anything else
    that stops the loop, whatever its type (``BaseException`` included), fails every
    in-flight request with ``EngineDeadError``, marks the engine unhealthy and is
    logged; later requests fail at once. No consumer is ever left waiting. With a
    ``step_timeout``, a pass that runs longer (a hung kernel or collective, a stopped
    worker) does the same (``watchdog.py``): the engine is latched dead, its
    requests fail, and the loop, should the pass ever return, touches nothing more.

Streams and ids
    A stream holds at most one pending output (plus a terminal error): a new
    output merges into the one not yet read (``merge_outputs``), so a reader that
    falls behind costs memory O(its request's length), never a queue of snapshots.
    Each stream has an engine-private key (the ``LLMEngine``'s request id); callers'
    ids only name the live request for ``abort``. So ``stream.abort()`` can only
    abort its own request, never a later one that reused its id.

Cancellation contract
    A consumer that stops iterating early (``break``, task cancelled, client
    gone) aborts its request; the loop frees its blocks before the next step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from paged_runtime.config import EngineConfig
from paged_runtime.engine.client import EngineDeadError, EngineOverloadedError, EngineStats, RequestFailedError
from paged_runtime.engine.core import CoreStats
from paged_runtime.engine.llm_engine import LLMEngine
from paged_runtime.engine.processor import ProcessedPrompt, Processor, PromptType
from paged_runtime.engine.watchdog import StepWatchdog
from paged_runtime.lora.request import LoRARequest
from paged_runtime.metrics import FinishedRequestStats, IterationStats, StatLogger
from paged_runtime.outputs import CompletionOutput, RequestOutput
from paged_runtime.pooling_params import PoolingParams, check_runner, request_pooling
from paged_runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineOverloadedError", "EngineStats", "RequestFailedError",
           "RequestStream", "merge_outputs"]


def merge_outputs(older: RequestOutput, newer: RequestOutput, kind: RequestOutputKind) -> RequestOutput:
    """One output standing for ``older`` then ``newer`` (a reader that has not taken ``older`` yet).

    Per completion index: DELTA outputs concatenate (text, token_ids, logprobs and the delta fields);
    CUMULATIVE and FINAL_ONLY ones take the newer completion but keep both steps' delta fields, so a
    streaming reader loses no text. Finish reasons and the request's fields come from ``newer``. A
    sequence only in ``older`` stays, except under a finished non-DELTA output (it holds the whole
    answer: the n best, re-indexed). Pure: neither input is changed.
    """
    newer_indices = {c.index for c in newer.outputs}
    completions = [_merge_completion(old, new, kind) for old in older.outputs for new in newer.outputs
                   if old.index == new.index]
    merged = {c.index for c in completions}
    completions += [c for c in newer.outputs if c.index not in merged]
    if kind == RequestOutputKind.DELTA or not newer.finished:
        completions += [c for c in older.outputs if c.index not in newer_indices]
    completions.sort(key=lambda c: c.index)
    prompt_logprobs = newer.prompt_logprobs if newer.prompt_logprobs is not None else older.prompt_logprobs
    return replace(newer, outputs=completions, prompt_logprobs=prompt_logprobs)


def _merge_completion(old: CompletionOutput, new: CompletionOutput, kind: RequestOutputKind) -> CompletionOutput:
    deltas = dict(delta_text=old.delta_text + new.delta_text,
                  delta_token_ids=old.delta_token_ids + new.delta_token_ids,
                  delta_logprobs=old.delta_logprobs + new.delta_logprobs)
    if kind != RequestOutputKind.DELTA:
        return replace(new, **deltas)
    logprobs = new.logprobs if old.logprobs is None or new.logprobs is None else old.logprobs + new.logprobs
    return replace(new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids, logprobs=logprobs,
                   **deltas)


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished output (``client.RequestStream``).

    Filled by the loop thread (``put``), drained by one consumer on ``loop``. Holds at most one pending
    output (later ones merge into it, see ``merge_outputs``) and the first terminal error, which is raised
    once the pending output is taken. Leaving the iteration early, or calling ``abort()``, aborts the
    request: the one this stream belongs to (by its private ``key``), whatever reuses its id later.
    """

    def __init__(self, request_id: str, key: str, loop: asyncio.AbstractEventLoop, engine: AsyncEngine,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.request_id = request_id  # the caller's
        self.finished = False
        self.output_kind = output_kind
        self._key = key
        self._loop = loop
        self._engine = engine
        self._lock = threading.Lock()  # guards the three fields below (loop thread vs consumer)
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._wake_scheduled = False
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Called from the loop thread; False when the consumer's event loop is gone."""
        with self._lock:
            if isinstance(item, BaseException):
                self._error = self._error or item
            else:
                self._pending = item if self._pending is None else merge_outputs(self._pending, item,
                                                                                 self.output_kind)
            if self._wake_scheduled:
                return True  # the consumer's loop will look at the merged state anyway
            self._wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
            return True
        except RuntimeError:  # the event loop is closed: nobody will read this
            with self._lock:
                self._wake_scheduled = False
            return False

    def _wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while True:
            with self._lock:
                item, self._pending = self._pending, None
                error = self._error
            if item is not None or error is not None:
                break
            self._ready.clear()  # no wake-up is lost: ``_wake`` runs on this loop, after this
            try:
                await self._ready.wait()
            except BaseException:
                self.abort()  # cancelled while waiting: the consumer is gone
                raise
        if item is None:
            self.finished = True
            raise error
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort this stream's request unless it already finished; idempotent and safe from any thread."""
        if not self.finished:
            self.finished = True
            self._engine._abort_key(self._key)


@dataclass(slots=True)
class _Submitted:
    key: str  # the engine-private id the LLMEngine gets
    prompt: ProcessedPrompt
    params: SamplingParams
    priority: int
    cache_salt: str | None
    pooling: PoolingParams | None = None
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Tracked:
    """Loop-side bookkeeping of one request: its stream, timings and last outputs (for an abort)."""
    stream: RequestStream
    arrival: float
    num_prompt_tokens: int
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generation_tokens: int = 0
    last_outputs: dict[int, CompletionOutput] = field(default_factory=dict)


class AsyncEngine:
    """Owns an ``LLMEngine`` and runs its step loop on a dedicated daemon thread (started here).

    Given an ``EngineConfig``, the loop thread itself builds the engine, so model loading and every
    step run on one thread. That matters on CPU: torch's OpenMP keeps one worker pool per thread that
    starts parallel work, and once the pools' threads outnumber the cores libgomp stops spinning
    between parallel regions; a decode step then measured ~50% slower on 2 cores. An ``LLMEngine``
    built elsewhere is accepted too (fine on GPU).
    """

    def __init__(self, engine: LLMEngine | EngineConfig, *, max_waiting_requests: int | None = None,
                 stat_loggers: Sequence[StatLogger] = (), stats_flush_interval: float = 10.0,
                 registry=None, step_timeout: float | None = None) -> None:
        """Starts the loop thread and returns once the engine is ready; an engine that fails to build
        raises here. ``stats_flush_interval``: after activity stops, the loop wakes once this much later
        so the stat loggers see the idle state (a log line's last interval) without a timer of their own.
        ``registry``: the Prometheus registry of the engine's own counters, for an engine built here.
        ``step_timeout``: seconds one pass may run before the engine is declared stalled (None: never)."""
        self.max_waiting_requests = _checked_waiting_limit(max_waiting_requests)
        self.stat_loggers = list(stat_loggers)
        self.stats_flush_interval = stats_flush_interval
        self.stats = EngineStats()
        self.dead_error: EngineDeadError | None = None
        self._cond = threading.Condition()
        self._inbox: list[_Submitted] = []
        self._aborts: list[str] = []
        self._tracked: dict[str, _Tracked] = {}  # by private key: every request with a live stream; guarded by _cond
        self._live: dict[str, str] = {}  # caller's id -> key of its live request; guarded by _cond
        self._keys = itertools.count()
        self._stopping = False
        self._max_num_seqs_target: int | None = None  # a live change not yet fully applied; guarded by _cond
        self._reset_prefix_cache = False  # asked for, not yet done; guarded by _cond
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []  # for the loop; under _cond
        self._busy = False  # the engine has unfinished requests; read and written by the loop thread only
        self._unflushed = False  # the last pass did work; the loggers get one idle pass later (loop thread only)
        # Backpressure counts, guarded by _cond: the scheduler's queue as of the last look, and requests
        # taken from the inbox but not yet added (so a burst during a step cannot slip past the limit).
        self._num_waiting = 0
        self._num_adding = 0
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._watchdog = StepWatchdog(step_timeout, self._stalled) if step_timeout else None
        self._thread = threading.Thread(target=self._start_and_run, args=(engine, registry),
                                        name="paged-runtime-step-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> AsyncEngine:
        return cls(config, **kwargs)

    def _start_and_run(self, engine: LLMEngine | EngineConfig, registry) -> None:
        try:
            self._attach(LLMEngine(engine, registry) if isinstance(engine, EngineConfig) else engine)
        except BaseException as e:  # reported by __init__ in the caller's thread
            self._start_error = e
            return
        finally:
            self._ready.set()
        try:
            self._run()
        except BaseException as e:  # whatever it is (a bug, a device error, a BaseException): fail everyone
            logger.critical("the step loop died; every request fails and the engine is now unhealthy",
                            exc_info=True)
            self._die(EngineDeadError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        finally:
            self.engine.shutdown()  # the worker processes, if any, go with the loop
        self._die(EngineDeadError("the engine was shut down"))

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine  # the loop thread's alone (see the threading contract)
        self.config: EngineConfig = engine.config
        self.max_model_len = engine.max_model_len
        self.model_root = engine.model_root
        self.hidden_size = engine.hidden_size
        self._pooling_type = engine.pooling_type
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self._processor = Processor(self.tokenizer, engine.max_model_len, engine.vocab_size, engine.max_num_seqs,
                                    max_stop_strings=engine.config.max_stop_strings,
                                    max_stop_string_length=engine.config.max_stop_string_length,
                                    max_logprobs=engine.config.max_logprobs,
                                    grammars=engine.grammars)  # thread-safe: compiles are cached for the runner
        self.default_sampling = dict(engine.default_sampling)
        self.kv_events_endpoint = engine.kv_events_endpoint
        self.cpu_kernels = engine.cpu_kernels
        self._totals = engine.stats()  # counters as of the last pass; each pass reports the difference
        for stat_logger in self.stat_loggers:
            stat_logger.record_cache_config(engine.cache_config_info())

    # ---- the model, as callers see it -------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._processor.vocab_size

    @property
    def max_num_seqs(self) -> int:
        """The batch limit new requests' n / best_of are checked against (changed by ``set_max_num_seqs``)."""
        return self._processor.max_num_seqs

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and validate on the caller's side (its own tokenizer copy); raises ``ParameterError``."""
        return self._processor.process(prompt, params)

    def pooling_params(self, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        """See ``EngineClient.pooling_params``."""
        return request_pooling(self._pooling_type, self.hidden_size, self.config.normalize, dimensions, normalize)

    # ---- the caller's side (any event loop) -----------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    pooling: PoolingParams | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue a request; returns its stream. Call from a coroutine (it binds the running loop).

        Raises ValueError (bad prompt or parameters, id in use), EngineOverloadedError, EngineDeadError.
        """
        loop = asyncio.get_running_loop()
        self._check_alive()
        check_runner(self.config.is_pooling, pooling)
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.process(prompt, params)
        with self._cond:
            self._check_alive()
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._check_capacity()
            key = f"async-{next(self._keys)}"
            stream = RequestStream(request_id, key, loop, self, params.output_kind)
            self._tracked[key] = _Tracked(stream, time.monotonic(), len(processed.token_ids))
            self._live[request_id] = key
            self._inbox.append(_Submitted(key, processed, params, priority, cache_salt, pooling, lora_request))
            self._cond.notify()
        return stream

    async def generate(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                       request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                       pooling: PoolingParams | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they come; the last one has ``finished`` set.

        Leaving the loop early (or cancelling the task) aborts the request.
        """
        stream = self.add_request(request_id or uuid.uuid4().hex, prompt, params, priority, cache_salt, pooling,
                                  lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        """Abort the live request with this (caller's) id; its stream ends with finish_reason "abort". Unknown ids
        are ignored, and so is a request that already finished (a new one may hold its id by now)."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort the live request with the caller's id ``request_id``, if any; safe from any thread."""
        with self._cond:
            key = self._live.get(request_id)
            if key is not None:
                self._aborts.append(key)
                self._cond.notify()

    def _abort_key(self, key: str) -> None:
        """Abort the request of the stream with this private key (a no-op once it has left)."""
        with self._cond:
            self._aborts.append(key)
            self._cond.notify()

    def check_health(self) -> None:
        """Raises EngineDeadError unless the step loop is alive and serving."""
        self._check_alive()
        if not self._thread.is_alive():
            raise EngineDeadError("the engine's step loop is not running")
        if not self.engine.workers_alive():  # noticed here even while idle; the next step fails for good
            raise EngineDeadError("a worker process of the engine is gone")

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive() and self.engine.workers_alive()

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Change the batch limit live (e.g. from a Ray Serve ``reconfigure``); safe from any thread.

        Raising it takes effect at the next step. Lowering it preempts nobody: no request is admitted
        until the running ones fall below the new limit. The KV cache keeps the size it was built with.
        """
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        self._processor.max_num_seqs = max_num_seqs  # new requests' n / best_of are checked against it at once
        with self._cond:
            self._max_num_seqs_target = max_num_seqs
            self._cond.notify()

    def set_max_waiting_requests(self, limit: int | None) -> None:
        """Change the waiting-queue bound live (None: unbounded); requests already queued stay queued."""
        self.max_waiting_requests = _checked_waiting_limit(limit)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix before the next step (blocks in use keep their KV); safe from any thread."""
        with self._cond:
            self._reset_prefix_cache = True
            self._cond.notify()

    # ---- adapters (the loop thread reads them: the engine's executor is its alone) ---------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter on every worker; ``LoRAError`` says why it cannot run."""
        await self._on_loop(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter once its running requests finish; False if it was not held."""
        return await self._on_loop(lambda: self.engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._on_loop(self.engine.list_loras)

    async def _on_loop(self, call: Callable[[], Any]) -> Any:
        """``call()``'s result, run on the loop thread between passes."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._check_alive()
            self._calls.append((call, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    @property
    def num_unfinished_requests(self) -> int:
        with self._cond:
            return len(self._tracked)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight fail with EngineDeadError. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for stat_logger in self.stat_loggers:
            stat_logger.close()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _check_capacity(self) -> None:
        limit = self.max_waiting_requests
        if limit is not None and self._num_waiting + self._num_adding + len(self._inbox) >= limit:
            raise EngineOverloadedError(f"the server is overloaded: {limit} requests are already waiting "
                                        "(max_waiting_requests); retry later")

    # ---- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._aborts or self._busy
                           or self._max_num_seqs_target is not None or self._reset_prefix_cache
                           or self._calls):
                    if not self._cond.wait(self.stats_flush_interval if self._unflushed else None):
                        break  # idle for a whole interval after activity: one empty pass flushes the loggers
                if self._stopping or self.dead_error is not None:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                reset, self._reset_prefix_cache = self._reset_prefix_cache, False
                calls, self._calls = self._calls, []
                self._num_adding = len(inbox)
            with self._watchdog.watching() if self._watchdog else contextlib.nullcontext():
                if reset:
                    self.engine.reset_prefix_cache()
                for call, future in calls:
                    _settle(future, call)
                self._pass(inbox, aborts)

    def _pass(self, inbox: list[_Submitted], aborts: list[str]) -> None:
        """One pass: add, abort, step once, deliver, record stats."""
        stats = IterationStats(time.monotonic(), 0, 0, 0.0)
        self._apply_max_num_seqs()
        self._add(inbox)
        self._update_waiting()
        self._abort(aborts, stats)
        self._unflushed = bool(inbox or aborts or self._busy)
        if self.engine.has_unfinished_requests():
            step_start = time.monotonic()
            outputs = self.engine.step()
            stats.now = time.monotonic()
            self._mark_scheduled(step_start, stats)
            self._deliver(outputs, stats)
        self._busy = self.engine.has_unfinished_requests()
        self._update_waiting()
        self._finish_stats(stats)

    def _apply_max_num_seqs(self) -> None:
        """Moves the scheduler's limit toward the target, never below the requests running now."""
        with self._cond:
            target = self._max_num_seqs_target
        if target is None:
            return
        if self.engine.reconfigure(max_num_seqs=target):
            with self._cond:
                if self._max_num_seqs_target == target:  # not replaced by a newer call meanwhile
                    self._max_num_seqs_target = None

    def _update_waiting(self) -> None:
        num_waiting = self.engine.num_waiting_requests
        with self._cond:
            self._num_waiting, self._num_adding = num_waiting, 0

    def _untrack(self, key: str) -> _Tracked | None:
        """Forget a request that left (its caller's id is free again); call with ``_cond`` held."""
        tracked = self._tracked.pop(key, None)
        if tracked is not None and self._live.get(tracked.stream.request_id) == key:
            del self._live[tracked.stream.request_id]
        return tracked

    def _add(self, inbox: list[_Submitted]) -> None:
        for s in inbox:
            try:
                self.engine.add_request(s.key, s.prompt, s.params, s.priority, s.cache_salt, s.pooling,
                                        s.lora_request)
            except ValueError as e:  # e.g. an id still held by the engine: only this request fails
                with self._cond:
                    tracked = self._untrack(s.key)
                if tracked is not None:
                    tracked.stream.put(e)

    def _abort(self, keys: list[str], stats: IterationStats) -> None:
        if not keys:
            return
        self.engine.abort_request(keys)
        now = time.monotonic()
        with self._cond:
            aborted = [t for key in keys if (t := self._untrack(key)) is not None]
        for tracked in aborted:
            tracked.stream.put(_aborted_output(tracked))
            stats.finished.append(_finished("abort", tracked, now))

    def _mark_scheduled(self, step_start: float, stats: IterationStats) -> None:
        """Queue time ends at the start of the first step that computed any of the request's tokens."""
        with self._cond:
            pending = [(key, t) for key, t in self._tracked.items() if t.scheduled_at is None]
        for key, tracked in pending:
            if self.engine.is_scheduled(key):
                tracked.scheduled_at = step_start
                stats.queue_times.append(max(0.0, step_start - tracked.arrival))

    def _deliver(self, outputs: list[RequestOutput], stats: IterationStats) -> None:
        for output in outputs:
            key = output.request_id
            with self._cond:
                tracked = self._untrack(key) if output.finished else self._tracked.get(key)
            if tracked is None:
                continue  # aborted after this step began
            output.request_id = tracked.stream.request_id  # the caller's id, not the engine's key
            try:
                self._account(tracked, output, stats)
                item = RequestFailedError(output.error) if output.error is not None else output
                delivered = tracked.stream.put(item)
            except Exception:  # a bug in delivery fails this request alone; its consumer must not wait forever
                logger.exception("delivering an output of request %r failed", tracked.stream.request_id)
                with self._cond:
                    self._untrack(key)
                tracked.stream.put(RequestFailedError("the engine failed this request while delivering it"))
                delivered = False
            if not delivered and not output.finished:
                self._abort_key(key)  # the consumer's loop is gone, or its request failed

    def _account(self, tracked: _Tracked, output: RequestOutput, stats: IterationStats) -> None:
        num_new = sum(len(c.delta_token_ids) for c in output.outputs)
        for c in output.outputs:
            tracked.last_outputs[c.index] = c
        if num_new:
            if tracked.first_token_at is None:
                tracked.first_token_at = stats.now
                stats.time_to_first_tokens.append(stats.now - tracked.arrival)
                stats.num_prompt_tokens += tracked.num_prompt_tokens
            else:
                stats.inter_token_latencies.append(stats.now - tracked.last_token_at)
            tracked.last_token_at = stats.now
            tracked.num_generation_tokens += num_new
            stats.num_generation_tokens += num_new
        if output.finished:
            reason = "error" if output.error is not None else next(
                (c.finish_reason for c in output.outputs if c.finish_reason), "stop")
            stats.finished.append(_finished(reason, tracked, stats.now))

    def _finish_stats(self, stats: IterationStats) -> None:
        """Gauges from the engine's snapshot after this pass, counters as the difference from the last one."""
        now, before = self.engine.stats(), self._totals
        self._totals = now
        _since(stats, now, before)
        self.stats = EngineStats(now.num_running, now.num_waiting, now.kv_cache_usage, now.num_preemptions,
                                 now.num_prefix_queries, now.num_prefix_hits)
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:  # metrics must never take the engine down
                logger.exception("stat logger %r failed", stat_logger)

    def _stalled(self, reason: str) -> None:
        """The watchdog's verdict (on its thread): fail everyone now; the stuck loop thread keeps the engine."""
        logger.critical("%s", reason)
        self._die(EngineDeadError(reason), release=False)

    def _die(self, error: EngineDeadError, release: bool = True) -> None:
        """Latch ``error`` and fail every request in flight with it. ``release``: the caller is the loop
        thread (or the loop is gone), so the engine may be asked to give the blocks back."""
        with self._cond:
            if self.dead_error is None:
                self.dead_error = error
            tracked = list(self._tracked.items())
            self._tracked.clear()
            self._live.clear()
            self._inbox.clear()
            calls, self._calls = self._calls, []
        for _, t in tracked:
            t.stream.put(error)
        for _, future in calls:
            future.set_exception(error)
        if not release:
            return
        try:  # give the blocks back and show it in the metrics, if the engine still can
            self.engine.abort_request([key for key, _ in tracked])
            self._finish_stats(IterationStats(time.monotonic(), 0, 0, 0.0))
        except Exception:
            logger.debug("could not abort requests after the engine failed", exc_info=True)


def _finished(reason: str, tracked: _Tracked, now: float) -> FinishedRequestStats:
    """The finished request's stats; its phase times as far as it got (see ``FinishedRequestStats``)."""
    scheduled, first, last = tracked.scheduled_at, tracked.first_token_at, tracked.last_token_at
    return FinishedRequestStats(
        reason, now - tracked.arrival, tracked.num_prompt_tokens, tracked.num_generation_tokens,
        prefill_time=None if scheduled is None or first is None else max(0.0, first - scheduled),
        decode_time=None if first is None else last - first,
        inference_time=None if scheduled is None or last is None else max(0.0, last - scheduled))


def _since(stats: IterationStats, now: CoreStats, before: CoreStats) -> None:
    stats.num_running, stats.num_waiting, stats.kv_cache_usage = now.num_running, now.num_waiting, now.kv_cache_usage
    stats.lora = now.lora
    stats.num_preemptions = now.num_preemptions - before.num_preemptions
    stats.num_prefix_queries = now.num_prefix_queries - before.num_prefix_queries
    stats.num_prefix_hits = now.num_prefix_hits - before.num_prefix_hits
    spec, spec_before = now.spec, before.spec
    stats.num_spec_drafts = spec.num_drafts - spec_before.num_drafts
    stats.num_spec_draft_tokens = spec.num_draft_tokens - spec_before.num_draft_tokens
    stats.num_spec_accepted_tokens = spec.num_accepted_tokens - spec_before.num_accepted_tokens
    stats.spec_accepted_per_position = [a - b for a, b in zip(spec.accepted_per_position,
                                                              spec_before.accepted_per_position)]


def _checked_waiting_limit(limit: int | None) -> int | None:
    if limit is not None and int(limit) < 1:
        raise ValueError(f"max_waiting_requests must be at least 1 or None, got {limit}")
    return None if limit is None else int(limit)


def _aborted_output(tracked: _Tracked) -> RequestOutput:
    """The last known state of each sequence (nothing of it new), marked aborted, so a live consumer's
    iteration ends cleanly; under DELTA, empty (the consumer has the rest already)."""
    outputs = []
    for index in sorted(tracked.last_outputs):
        c = copy.copy(tracked.last_outputs[index])
        if tracked.stream.output_kind == RequestOutputKind.DELTA:
            c.text, c.token_ids, c.logprobs = "", [], None if c.logprobs is None else []
        c.finish_reason, c.delta_text, c.delta_token_ids, c.delta_logprobs = "abort", "", [], []
        outputs.append(c)
    return RequestOutput(tracked.stream.request_id, None, [], outputs, True)


def _settle(future: concurrent.futures.Future, call: Callable[[], Any]) -> None:
    """Run ``call`` into ``future`` (its result, or the exception it raised)."""
    try:
        future.set_result(call())
    except Exception as e:
        future.set_exception(e)
