"""The engine core: scheduler + model runner, one token-level step at a time.

It knows nothing of text. ``step()`` schedules, runs the forward pass and
returns the requests that received a token (finished ones included).

When the model runner raises, the step is contained: the requests it concerns (the one the
runner could not set up, else every request of the step) are finished with
``FINISHED_ERROR``, their blocks freed and the runner's state of them dropped, the invariants
are checked, and ``StepFailure`` names their groups; everyone else goes on as if the step had
not happened. An error anywhere else (the scheduler), a failed check, or a third forward pass
in a row that fails, propagates: the state cannot be trusted and the engine must stop.

Asynchronous scheduling (``EngineConfig.async_scheduling``; vLLM's ``--async-scheduling``): the
runner executes steps on one step thread, in order, and ``step()`` schedules and launches step
N + 1 before it waits for step N, so scheduling, output processing and the caller's work overlap
the forward pass. A decoding request of step N is in step N + 1 with its token as a placeholder
the runner fills in (see ``core/scheduler.py``). ``step()`` then returns step N's news: one step
later than it happened, and nothing the first time. Stop strings and aborts applied between steps
take effect within one step (a finished request's tokens from the step in flight are dropped).
When step N fails, step N + 1 refuses to run (it was scheduled on outputs that never came) and is
rolled back (``Scheduler.unschedule``) before step N's requests are failed as above.

An encoder-only model (``ModelFamily.encoder_only``: BERT) attends both ways over each whole prompt and keeps no KV,
as vLLM runs one: each prompt is computed whole in one step (the scheduler's ``chunked_prefill`` off, and a step
budget of at least ``max_model_len``, refused below it), and prefix caching is off (no hit could skip a token,
and no block holds KV worth publishing). Its blocks cost nothing (``worker/kv_budget.py``); they only count
tokens, so no request is ever preempted.

KV-cache events (``EngineConfig.kv_events_config``; ``core/kv_events.py``): the KV-cache manager records what
the block pool stores, evicts and clears; every ``step()`` (failed or not) and every ``reset_prefix_cache()``
ends by handing what was recorded, if anything, to the publisher as one batch. One publisher per engine,
whatever its tensor and pipeline ranks: the block pool lives here, not in the workers.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged_runtime.config import EngineConfig
from paged_runtime.utils.devices import resolve_device, resolve_precision
from paged_runtime.core.kv_cache_manager import KVCacheManager, blocks_needed
from paged_runtime.core.kv_events import KVEventRecorder
from paged_runtime.engine.kv_event_publisher import EventPublisher, make_publisher
from paged_runtime.core.scheduler import Scheduler
from paged_runtime.core.scheduler_output import SchedulerOutput
from paged_runtime.executor import ExecutorDead, UniProcExecutor, check_parallel, make_executor
from paged_runtime.models import registry as model_registry
from paged_runtime.models.loader import resolve_model_path, serves_gguf_blocks
from paged_runtime.pooling_params import folder_max_seq_length
from paged_runtime.spec_decode.config import SpeculativeConfig
from paged_runtime.spec_decode.speculator import Speculator
from paged_runtime.structured_output.backend import GrammarBackend
from paged_runtime.lora.request import LoRAError, LoRARequest
from paged_runtime.metrics import LoRAStats
from paged_runtime.request import Request, RequestStatus
from paged_runtime.worker.model_runner import ModelRunner, RequestSetupError, TokenLogprobs
from paged_runtime.worker.worker import WorkerSpec
from paged_runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)

# Forward passes that fail one after another, none succeeding between: the engine, not a batch, is broken.
MAX_FAILED_STEPS_IN_A_ROW = 3


class StaleStep(Exception):
    """Not run: the step before it failed, and this one was scheduled on that step's outputs."""


class StepFailure(Exception):
    """A step failed for the requests of ``group_ids`` alone; they are already finished with
    ``FINISHED_ERROR`` and the invariants hold. The cause is ``__cause__``."""

    def __init__(self, group_ids: list[str], updates: list[StepUpdate] | None = None) -> None:
        super().__init__(f"a step failed for requests {group_ids}")
        self.group_ids = group_ids
        self.updates = updates or []  # the step's other news (requests the scheduler failed), to deliver anyway


@dataclass(slots=True)
class StepUpdate:
    """One new token of one sequence (a speculating sequence may get several per step, in
    order), with its logprobs when asked; or a chunk's prompt logprobs (token_id None)."""
    request: Request
    token_id: int | None
    logprobs: TokenLogprobs | None
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None
    pooled: list[float] | None = None  # a pooling request's vector (token_id None), as it finishes


@dataclass(slots=True)
class CoreStats:
    """The core as it stands: gauges as of now, counters cumulative since start-up (readers take deltas)."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks held by requests
    num_preemptions: int
    num_prefix_queries: int  # tokens looked up in the prefix cache
    num_prefix_hits: int  # tokens found there
    spec: SpecDecodeStats  # a copy: the core goes on counting into its own
    lora: LoRAStats | None = None  # the adapters running and waiting (None: LoRA is off)


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative speculative-decoding counts since start-up."""
    num_drafts: int = 0  # verifications (requests that speculated, summed over steps)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def record(self, num_spec: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_spec
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))


class EngineCore:
    def __init__(self, config: EngineConfig, model_path, model_config: ModelConfig, registry=None) -> None:
        """``registry``: the Prometheus registry of the KV-event publisher's counter (default: the process's)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.precision = resolve_precision(config.dtype, config.kv_cache_dtype, model_config.torch_dtype, self.device,
                                           serves_gguf_blocks(model_path, config.quantization))
        self.dtype = self.precision.dtype
        self.max_model_len = _max_model_len(config, model_config, model_path)
        family = model_registry.family(model_config.architecture)
        encoder = family.encoder_only  # each prompt whole in one step, no prefix cache (see the module docstring)
        self.max_num_batched_tokens = _step_budget(config, self.max_model_len, family, self.device)
        spec = config.speculative_config
        draft_path, draft_config = self._draft(spec, model_config) if spec and spec.method == "draft_model" else (
            None, None)
        window = kv_sliding_window(model_config, draft_config)
        per_request = None if window is None else blocks_needed(self.max_model_len, config.block_size, window,
                                                                self.max_num_batched_tokens)
        check_parallel(config, model_config, self.device)
        self.executor = make_executor(WorkerSpec(config, model_path, self.dtype, self.max_model_len, draft_path,
                                                 per_request, spec.num_speculative_tokens if spec else 0,
                                                 self.precision.kv_cache_dtype))
        info = self.executor.info
        self.num_blocks, self.attention_backend = info.num_blocks, info.attention_backend
        self.cpu_kernels = info.cpu_kernels  # the driver rank's (kernels/cpu.info()), or None
        events = config.kv_events_config
        self.kv_events = KVEventRecorder(config.block_size) if events is not None and events.active else None
        self.kv_cache = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching and not encoder,
                                       window, config.prefix_caching_hash_algo, self.kv_events)
        self.kv_event_publisher = self._publisher(registry)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.scheduling_policy, Speculator(spec) if spec else None, self.max_model_len,
                                   rope_switch=info.rope_switch, chunked_prefill=not encoder,
                                   max_loras=config.max_loras if config.enable_lora else None,
                                   long_prefill_token_threshold=_long_prefill_threshold(config, self.max_model_len))
        self.loras: dict[int, LoRARequest] = {}  # adapters the workers hold, by id
        self._unloading: set[int] = set()  # removed adapters the workers keep until their last request leaves
        self.num_failed_steps_in_a_row = 0
        self._step_thread = ThreadPoolExecutor(1, "paged-runtime-step") if self._async_scheduling(spec) else None
        self._in_flight: tuple[SchedulerOutput, Future] | None = None  # the step launched, not yet applied
        self._failed_step = False  # the step thread refuses queued steps until the failure is contained
        self.spec_stats = SpecDecodeStats(accepted_per_position=[0] * (spec.num_speculative_tokens if spec else 0))
        logger.info("engine ready: %s %s (KV cache %s), %d KV blocks of %d tokens, max_model_len %d, %s",
                    model_config.architecture, self.dtype, self.precision.kv_cache_dtype, self.num_blocks,
                    config.block_size, self.max_model_len,
                    f"{info.ops_name} ops, {self.attention_backend} attention"
                    + (f", {config.tensor_parallel_size} x {config.pipeline_parallel_size} ranks (tensor x pipeline)"
                       if config.world_size > 1 else "")
                    + (", asynchronous scheduling" if self._step_thread else ""))

    def _publisher(self, registry) -> EventPublisher:
        try:
            return make_publisher(self.config.kv_events_config, self.config.kv_events_format,
                                  self.config.served_model_names[0], registry)
        except BaseException:
            self.executor.shutdown()  # e.g. the endpoint's port is taken: the engine never starts
            raise

    def _async_scheduling(self, spec: SpeculativeConfig | None) -> bool:
        """The configured choice; by default on for one CUDA device (host work hides behind the device's) and
        off on the CPU, where the forward pass and the host share the same cores, with speculative decoding,
        and with several ranks (the ranks that do not sample take each step's tokens from the scheduler)."""
        requested = self.config.async_scheduling
        if requested is None:
            return self.device.type == "cuda" and spec is None and self.config.world_size == 1
        return requested

    def _draft(self, spec: SpeculativeConfig, target: ModelConfig) -> tuple[Path, ModelConfig]:
        path = resolve_model_path(spec.model, self.config.cache_dir)
        draft_config = ModelConfig.from_folder(path)
        if draft_config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_config.vocab_size} tokens) differs from the "
                             f"target's ({target.vocab_size}); speculative decoding needs the same tokenizer")
        return path, draft_config

    # ---- the in-process worker (one device): tests and benchmarks look at its model and runner ----------
    @property
    def runner(self) -> ModelRunner:
        return self._local_worker().runner

    @property
    def ops(self):
        return self._local_worker().ops

    def _local_worker(self):
        if not isinstance(self.executor, UniProcExecutor):
            raise AttributeError("the model runs in worker processes: there is no in-process runner")
        return self.executor.worker

    def use_grammars(self, grammars: GrammarBackend) -> None:
        """Structured-output constraints compile with ``grammars`` (built once the tokenizer is loaded);
        until then a constrained request cannot be set up."""
        self.executor.use_grammars(grammars)

    def shutdown(self) -> None:
        """Stop the workers (after the step in flight) and the KV-event publisher; idempotent."""
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self.executor.shutdown()
        self.kv_event_publisher.close()

    def add_request(self, request: Request) -> None:
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        self.scheduler.add_request(request)

    # ---- adapters ------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Have every worker read and check the adapter (``LoRAError`` says why it cannot run); a no-op for one
        already held. Its requests' KV is its own in the prefix cache (``block_hash.block_extra_keys``)."""
        if not self.config.enable_lora:
            raise LoRAError("LoRA is not enabled: start the engine with --enable-lora (LLM(enable_lora=True))")
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise LoRAError(f"adapter id {lora_request.lora_int_id} is already {known.lora_name!r}")
        self._unloading.discard(lora_request.lora_int_id)
        if known is None:
            self._wait_in_flight()
            self.executor.add_lora(lora_request)
            self.loras[lora_request.lora_int_id] = lora_request

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests already running with it finish first (the workers drop it after the
        last one leaves). False if it was not held."""
        if lora_id not in self.loras or lora_id in self._unloading:
            return False
        self._unloading.add(lora_id)
        self._drop_unused_loras()
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras) - self._unloading

    def _drop_unused_loras(self) -> None:
        if not self._unloading:
            return
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        for lora_id in sorted(self._unloading - in_use):
            self._wait_in_flight()
            self.executor.remove_lora(lora_id)
            del self.loras[lora_id]
            self._unloading.discard(lora_id)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, status)

    @property
    def async_scheduling(self) -> bool:
        return self._step_thread is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand the events recorded since the last call to the publisher, as one batch (none if none)."""
        if self.kv_events is not None:
            events = self.kv_events.take()
            if events:
                self.kv_event_publisher.publish(events)

    def step(self, sync: bool = False) -> list[StepUpdate]:
        """One scheduling step and forward pass; the sequences' new tokens and prompt logprobs, and
        (token_id None, status FINISHED_ERROR) every request the scheduler failed. With asynchronous
        scheduling, the tokens are those of the step launched by the previous call, unless ``sync``
        (beam search: its driver picks each beam's next token between steps). Ends by publishing the
        step's KV-cache events."""
        try:
            return self._step(sync)
        finally:
            self._publish_kv_events()
            self._drop_unused_loras()

    def _step(self, sync: bool) -> list[StepUpdate]:
        if self._step_thread is None or sync:
            return self._drain() + self._step_now()
        out, failed = self._schedule()
        launched = None if out.empty else (out, self._step_thread.submit(self._run, out))
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return failed
        return failed + self._complete(previous[0], previous[1].result, failed)

    def _schedule(self) -> tuple[SchedulerOutput, list[StepUpdate]]:
        """The next step, and (token_id None) the requests the scheduler failed while making it."""
        out = self.scheduler.schedule()
        return out, [StepUpdate(request, None, None, None) for request in self.scheduler.take_failed()]

    def _step_now(self) -> list[StepUpdate]:
        out, failed = self._schedule()
        if out.empty:
            return failed
        return failed + self._complete(out, lambda: self._run(out), failed)

    def _drain(self) -> list[StepUpdate]:
        """Wait for the step in flight and apply its output; its news."""
        previous, self._in_flight = self._in_flight, None
        return [] if previous is None else self._complete(previous[0], previous[1].result, [])

    def _run(self, out: SchedulerOutput):
        """The runner's output for ``out``; on the step thread with asynchronous scheduling (steps in order)."""
        if self._failed_step:
            raise StaleStep()
        try:
            return self.executor.execute(out)
        except BaseException:
            self._failed_step = True
            raise

    def _complete(self, out: SchedulerOutput, result, failed: list[StepUpdate]) -> list[StepUpdate]:
        """Apply ``result()`` (the runner's output for ``out``) to the scheduler: the step's news."""
        try:
            output = result()
        except Exception as e:
            raise self._step_failed(out, e, failed) from (e.__cause__ if isinstance(e, RequestSetupError) else e)
        self.num_failed_steps_in_a_row = 0
        appended = self.scheduler.update_from_output(out, output.token_ids)
        updates = []
        pooled = output.pooled or [None] * len(appended)
        for (request, tokens), logprobs, prompt_logprobs, vector in zip(appended, output.logprobs,
                                                                        output.prompt_logprobs, pooled):
            if request is None:  # finished while the step ran
                continue
            if vector is not None and request.status == RequestStatus.FINISHED_STOPPED:  # else preempted: recomputed
                updates.append(StepUpdate(request, None, None, None, vector))
            if prompt_logprobs is not None:
                updates.append(StepUpdate(request, None, None, prompt_logprobs))
            updates += [StepUpdate(request, token_id, logprobs[i] if logprobs else None, None)
                        for i, token_id in enumerate(tokens)]
        self._record_spec(out, output.token_ids)
        if self.config.debug_checks:
            self.scheduler.check_invariants()
        return updates

    def _step_failed(self, out: SchedulerOutput, error: Exception, failed: list[StepUpdate]) -> StepFailure:
        """Contain a failed step: the step queued behind it is rolled back; the requests concerned fail (the one
        the runner could not set up, else every request of the step), the others are rescheduled. Raises
        ``error`` itself when the runner is broken (failures in a row)."""
        queued, self._in_flight = self._in_flight, None
        if queued is not None:
            wait([queued[1]])  # it refuses to run (StaleStep): nothing of it reached the runner
            self.scheduler.unschedule(queued[0], resend=True)
        if isinstance(error, ExecutorDead):
            raise error  # a worker is gone: nothing can run
        if isinstance(error, RequestSetupError):  # only these requests: the others' items did not run
            self.scheduler.unschedule(out, resend=False)
            request_ids = error.request_ids
        else:  # the forward pass or sampling: every request in it is suspect
            self.num_failed_steps_in_a_row += 1
            if self.num_failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise error  # not one bad batch: the device or the runner itself
            request_ids = [s.request_id for s in out.scheduled]
        failure = self._contain(request_ids, failed)
        self._failed_step = False
        return failure

    def _contain(self, request_ids: list[str], updates: list[StepUpdate]) -> StepFailure:
        """Fail the groups of ``request_ids``; ``updates`` (what the scheduler failed this step) still go out."""
        requests = self.scheduler.requests
        group_ids = sorted({requests[r].group_id for r in request_ids if r in requests})
        self.fail_groups(group_ids)
        return StepFailure(group_ids, updates)

    def fail_groups(self, group_ids: list[str]) -> None:
        """Finish every sequence of these groups with FINISHED_ERROR (blocks freed, the runner's state
        dropped at once), then check the invariants; raises if the state cannot be trusted."""
        self._wait_in_flight()
        groups = set(group_ids)
        failed = [rid for rid, r in self.scheduler.requests.items() if r.group_id in groups]
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        self.executor.retain(self.scheduler.requests)  # also rows of requests that finished normally
        self.check_invariants()

    def _wait_in_flight(self) -> None:
        """Let the step in flight finish (its output stays to be applied): the runner is then idle."""
        if self._in_flight is not None:
            wait([self._in_flight[1]])

    def check_invariants(self) -> None:
        """Blocks held exactly by the live requests' tables, free counts consistent, no finished request
        left in the scheduler or the runner, and (on CUDA) a device that still works."""
        self._wait_in_flight()
        scheduler = self.scheduler
        scheduler.check_invariants()
        live = scheduler.running + scheduler.waiting
        assert {r.request_id for r in live} == set(scheduler.requests), "the scheduler's queues and requests differ"
        assert not any(r.status.finished for r in live), "a finished request is still scheduled"
        self.executor.check_invariants(scheduler.requests)  # and, on CUDA, that the devices still work

    def stats(self) -> CoreStats:
        """A snapshot, taken on demand (after a step, an add or an abort) rather than every step for nobody."""
        kv = self.kv_cache
        return CoreStats(self.scheduler.num_running, self.scheduler.num_waiting, kv.usage(),
                         self.scheduler.num_preemptions, kv.num_queried_tokens, kv.num_hit_tokens,
                         self.spec_stats.copy(), self._lora_stats())

    def _lora_stats(self) -> LoRAStats | None:
        if not self.config.enable_lora:
            return None
        scheduler = self.scheduler
        names = [sorted({r.lora_name for r in queue if r.lora_name}) for queue in (scheduler.running,
                                                                                   scheduler.waiting)]
        return LoRAStats(self.config.max_loras, tuple(names[0]), tuple(names[1]))

    def _record_spec(self, out: SchedulerOutput, sampled: list[list[int]]) -> None:
        # Only the step knows how many drafts each verification accepted: count them as they happen.
        for item, tokens in zip(out.scheduled, sampled):
            if item.num_spec:
                self.spec_stats.record(item.num_spec, len(tokens) - 1)


def kv_sliding_window(model_config: ModelConfig, draft_config: ModelConfig | None) -> int | None:
    """The window the KV manager may release blocks behind: every layer's (the largest), when every layer
    slides; None, keeping every block, when any layer attends to the whole context (Gemma 3's global layers)
    or a draft model shares the tables (its catch-up queries start before the step's first position)."""
    windows = model_config.layer_windows
    if not windows:
        return None
    if None in windows:
        logger.info("%d of %d layers slide, the others read the whole context: the KV cache keeps every block",
                    len(windows) - windows.count(None), len(windows))
        return None
    if draft_config is not None:
        logger.info("a draft model shares the block tables: the KV cache keeps blocks outside the sliding window")
        return None
    return max(windows)


def _step_budget(config: EngineConfig, max_model_len: int, family: model_registry.ModelFamily,
                 device: torch.device) -> int:
    """Tokens per step: ``max_num_batched_tokens``; by default 2048 on the CPU (vLLM's default for its CPU server:
    every running stream waits for a step, and on a few cores one of 8,192 prompt tokens takes seconds), and
    max(2048, min(max_model_len, 8192)) on a GPU. An encoder-only family computes each prompt in one step, so its
    budget covers ``max_model_len``: the default grows to it, and a smaller one is refused (as vLLM refuses it
    without chunked prefill)."""
    default = 2048 if device.type == "cpu" else max(2048, min(max_model_len, 8192))
    if not family.encoder_only:
        return config.max_num_batched_tokens or default
    if config.max_num_batched_tokens is None:
        return max(default, max_model_len)
    if config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                         f"({max_model_len}): {family.architecture} is an encoder-only model, which computes each "
                         f"prompt in one step; raise max_num_batched_tokens or lower max_model_len")
    return config.max_num_batched_tokens


def _long_prefill_threshold(config: EngineConfig, max_model_len: int) -> int:
    """``long_prefill_token_threshold``, refused past ``max_model_len`` as vLLM refuses it."""
    if config.long_prefill_token_threshold > max_model_len:
        raise ValueError(f"long_prefill_token_threshold ({config.long_prefill_token_threshold}) cannot be greater "
                         f"than max_model_len ({max_model_len})")
    return config.long_prefill_token_threshold


def _max_model_len(config: EngineConfig, model_config: ModelConfig, model_path: Path) -> int:
    """``max_model_len``, within the model's positions. Unset: the positions, or a sentence-transformers folder's
    ``max_seq_length`` where smaller (what the embedder was trained on, as vLLM reads it); set, it may go past
    that, up to the positions."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return min(limit, folder_max_seq_length(model_path) or limit)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens")
    return config.max_model_len
