"""The synchronous engine: text in, text out, one step at a time.

Wraps the token-level ``EngineCore`` with the processor (tokenize, validate)
on the way in and, on the way out, per-sequence incremental detokenization,
stop strings (a stop string ends its sequence in the step it appears) and
logprobs. A request with n / best_of > 1 is one group of sequences; its
output is finished when all of them are, and then holds the n best.

Ids: the core knows a request only by an id the engine makes (a group id, its
parallel-sampling children derived from it); callers' ids live in a map here
and in the outputs, so no caller string can equal another request's internal
id. ``add_request`` refuses a caller id still in use; ``abort_request`` takes
callers' ids.

Outputs follow ``params.output_kind``: CUMULATIVE (everything so far, plus the
step's ``delta_*``), DELTA (only what the step added, no copy of the sequence)
or FINAL_ONLY (one output, at the end). A request the core fails (it can never
fit the KV cache) ends with ``RequestOutput.error`` and finish_reason "error".

Pooling (``EngineConfig.runner == "pooling"``): every request is a pooling request (``add_request``'s
``pooling``, from ``pooling_params``): prefill only, one finished output whose ``pooling`` holds the vector and
whose ``outputs`` is empty. A generation request to a pooling engine, or a pooling request to a generating
one, is a ValueError. An encoder-only model pools whatever ``runner`` says but generate (refused): ``config`` is
then the given one with ``runner="pooling"`` (``pooling_params.resolve_runner``), which the front ends read.

Declared API (what ``LLM`` and ``AsyncEngine`` use): ``config``, ``tokenizer``,
``max_model_len``, ``default_sampling``, ``model_root``, ``vocab_size``, ``max_num_seqs``,
``process``, ``pooling_params``, ``add_request``, ``abort_request``, ``step``,
``has_unfinished_requests``, ``is_scheduled``, ``stats``, ``reconfigure``,
``reset_prefix_cache`` and ``beam_search``. ``core`` stays reachable for
tests and benchmarks that inspect the scheduler; front ends never use it.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from paged_runtime.config import EngineConfig
from paged_runtime.engine.beam_search import BeamSearchDriver, BeamSearchParams, BeamSearchSequence
from paged_runtime.engine.core import CoreStats, EngineCore, StepFailure, StepUpdate
from paged_runtime.engine.detokenizer import IncrementalDetokenizer
from paged_runtime.engine.generation_config import default_sampling, log_defaults
from paged_runtime.engine.processor import ProcessedPrompt, Processor, PromptType
from paged_runtime.models import registry as model_registry
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.loader import load_tokenizer, resolve_model_path
from paged_runtime.structured_output.backend import GrammarBackend
from paged_runtime.outputs import CompletionOutput, Logprob, PoolingOutput, PositionLogprobs, RequestOutput
from paged_runtime.pooling_params import (PoolingParams, check_runner, folder_pooling_type, request_pooling,
                                          resolve_runner)
from paged_runtime.lora.request import LoRARequest
from paged_runtime.request import Request, RequestStatus, child_request_id
from paged_runtime.sampling_params import RequestOutputKind, SamplingParams
from paged_runtime.worker.model_runner import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class Sequence:
    """Output-side state of one sampled sequence."""
    detokenizer: IncrementalDetokenizer
    completion: CompletionOutput
    stopped: bool = False  # a stop string ended it: later tokens of the same step are dropped


@dataclass
class RequestState:
    """Output-side state of one user request (a group of best_of sequences)."""
    request_id: str  # the caller's
    group_id: str  # the engine's: what the core knows the group by
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[int, Sequence] = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the core failed the group
    pooling: PoolingParams | None = None  # a pooling request
    pooled: list[float] | None = None  # its vector, once computed

    @property
    def finished(self) -> bool:
        if self.pooling is not None:
            return self.error is not None or self.pooled is not None
        return self.error is not None or (len(self.sequences) == self.params.best_of
                                          and all(s.completion.finish_reason for s in self.sequences.values()))


class LLMEngine:
    def __init__(self, config: EngineConfig, registry=None) -> None:
        """``registry``: the Prometheus registry of the engine's own counters (the KV-event publisher's; default:
        the process's)."""
        self.model_path = resolve_model_path(config.model, config.cache_dir)
        model_config = ModelConfig.from_folder(self.model_path)
        family = model_registry.family(model_config.architecture)
        runner = resolve_runner(config.runner, family.architecture, family.encoder_only)
        self.config = config = config if runner == config.runner else dataclasses.replace(config, runner=runner)
        self.core = EngineCore(config, self.model_path, model_config, registry)
        self.tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else self.model_path)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, self.model_path, model_config)
        self.grammars = GrammarBackend(self.tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.core.use_grammars(self.grammars)
        self.max_model_len = self.core.max_model_len
        self.hidden_size = model_config.hidden_size
        # --runner pooling: the configured pooling, else the folder's sentence-transformers config, else the
        # family's (LAST for decoders, CLS for BERT, as vLLM)
        self.pooling_type = config.pooling_type or folder_pooling_type(self.model_path) or family.pooling_type
        self._processor = Processor(self.tokenizer, self.max_model_len, model_config.vocab_size,
                                    config.max_num_seqs, max_stop_strings=config.max_stop_strings,
                                    max_stop_string_length=config.max_stop_string_length,
                                    max_logprobs=config.max_logprobs, grammars=self.grammars)
        # Field -> value for requests that leave the field unset (the model's generation_config.json).
        self.default_sampling = default_sampling(self.model_path, config.generation_config)
        log_defaults(self.default_sampling)
        self.states: dict[str, RequestState] = {}  # by internal group id
        self._group_ids: dict[str, str] = {}  # caller's request id -> internal group id
        self._arrivals = itertools.count()
        self.decode_token = lru_cache(maxsize=65536)(lambda t: self.tokenizer.decode([t]))

    def pooling_params(self, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        """A pooling request's parameters on this engine (its pooling type; ``normalize`` None: the engine's
        setting); ``ParameterError`` naming ``dimensions`` beyond the hidden size."""
        return request_pooling(self.pooling_type, self.hidden_size, self.config.normalize, dimensions, normalize)

    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None, pooling: PoolingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. A prompt processed elsewhere (``ProcessedPrompt``) is re-checked cheaply against
        this engine (length, token ids, output budget, stop caps): ``ParameterError`` names the field,
        ValueError for an id in use. Nothing a step cannot run gets in. ``pooling``: a pooling request (only on
        a ``--runner pooling`` engine, where every request is one). ``lora_request``: the adapter it runs with
        (read on first use; ``LoRAError`` where it cannot run)."""
        if request_id in self._group_ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_runner(self.config.is_pooling, pooling)
        if pooling is not None and params.best_of != 1:
            raise ValueError("a pooling request has one output: n and best_of must be 1")
        if isinstance(prompt, ProcessedPrompt):
            self._processor.check(prompt, params)
            processed = prompt
        else:
            processed = self.process(prompt, params)
        params = self._processor.engine_params(params)
        arrival = next(self._arrivals)
        group_id = f"{arrival}"  # the engine's own: callers' ids never reach the core
        request = Request(group_id, processed.token_ids, params, arrival, processed.max_tokens,
                          self.eos_token_ids, processed.prompt, priority, cache_salt, pooling=pooling,
                          lora_request=lora_request)
        self.core.add_request(request)
        self._group_ids[request_id] = group_id
        self.states[group_id] = RequestState(request_id, group_id, processed.prompt, processed.token_ids, params,
                                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                                             pooling=pooling)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by the callers' ids; ids not (or no longer) in the engine are ignored."""
        for request_id in request_ids:
            group_id = self._group_ids.pop(request_id, None)
            if group_id is not None:
                state = self.states.pop(group_id)
                ids = [child_request_id(group_id, i) for i in range(state.params.best_of)]
                self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- what the front ends may ask besides adding and stepping ----------------------
    @property
    def model_root(self) -> str:
        """The resolved model folder (what /v1/models reports as ``root``)."""
        return str(self.model_path)

    @property
    def vocab_size(self) -> int:
        return self._processor.vocab_size

    @property
    def max_num_seqs(self) -> int:
        """The batch limit new requests' n / best_of are checked against (see ``reconfigure``)."""
        return self._processor.max_num_seqs

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and validate a prompt against this engine; raises ``ParameterError`` naming the field."""
        return self._processor.process(prompt, params)

    def is_scheduled(self, request_id: str) -> bool:
        """True once the request has computed any token, or has left the engine (finished in a step)."""
        group_id = self._group_ids.get(request_id)
        request = self.core.scheduler.requests.get(group_id) if group_id is not None else None
        return request is None or request.num_computed_tokens > 0

    @property
    def num_waiting_requests(self) -> int:
        return self.core.scheduler.num_waiting

    def stats(self) -> CoreStats:
        """Where the engine stands: gauges now, counters since start-up (taken on demand, not every step)."""
        return self.core.stats()

    @property
    def kv_events_endpoint(self) -> str | None:
        """See ``EngineClient.kv_events_endpoint``."""
        return self.core.kv_event_publisher.bound_endpoint

    @property
    def cpu_kernels(self) -> dict | None:
        """See ``EngineClient.cpu_kernels``."""
        return self.core.cpu_kernels

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache as vLLM's ``cache_config_info`` metric labels it (``metrics.CACHE_CONFIG_LABELS``)."""
        config = self.config
        return {"block_size": str(config.block_size), "cache_dtype": config.kv_cache_dtype,
                "enable_prefix_caching": str(self.core.kv_cache.enable_caching),  # off for an encoder
                "gpu_memory_utilization": str(config.gpu_memory_utilization),
                "num_gpu_blocks": str(self.core.num_blocks), "num_cpu_blocks": "None",
                "prefix_caching_hash_algo": config.prefix_caching_hash_algo}

    def reconfigure(self, *, max_num_seqs: int) -> bool:
        """Move the batch limit to ``max_num_seqs``; True once fully applied, False to call again after a step.

        New requests are checked against it at once. The scheduler's limit never drops below the sequences
        running now plus the siblings their pending forks will add, so lowering it preempts nobody: it
        follows them down as they finish. A queued group
        larger than the new limit is not stranded: the scheduler admits it when nothing else runs, and it
        runs alone.
        """
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        self._processor.max_num_seqs = max_num_seqs
        scheduler = self.core.scheduler
        scheduler.max_num_seqs = max(max_num_seqs, scheduler.num_seats)
        return scheduler.max_num_seqs == max_num_seqs

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their KV)."""
        self.core.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter on every worker (``LoRAError`` says why it cannot run)."""
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter once its running requests finish; False if it was not held."""
        return self.core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.core.list_loras()

    def workers_alive(self) -> bool:
        """False once a worker process (or actor) is gone; safe from any thread (it only looks)."""
        return self.core.executor.alive()

    def shutdown(self) -> None:
        """Stop the worker processes, if any; idempotent. The engine cannot step afterwards."""
        self.core.shutdown()

    def beam_search(self, prompts: list[list[int]], params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
        """Beam search over token-id prompts (beams are forks inside the core); needs an idle engine."""
        if self.has_unfinished_requests():
            raise RuntimeError("beam_search needs an idle engine")
        return BeamSearchDriver(self.core, self.eos_token_ids).run(prompts, params)

    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every request that moved (finished ones included).

        A request the step failed (the runner raised on a batch holding it, or its own output processing
        raised: detokenizing, stop strings, logprobs) gets a finished output with ``error`` set, its
        blocks freed; the others go on. Raises only when the engine's state cannot be trusted.
        """
        try:
            updates = self.core.step()
        except StepFailure as failure:
            logger.error("a step failed; failing its requests %s", failure.group_ids, exc_info=failure.__cause__)
            errors = [self._error_output(group_id, failure.__cause__) for group_id in failure.group_ids]
            return self._outputs(failure.updates) + [output for output in errors if output is not None]
        except Exception:
            logger.critical("a step failed and the engine's state cannot be trusted: every request fails")
            raise  # with its traceback, logged where it is handled
        return self._outputs(updates)

    def _outputs(self, updates: list[StepUpdate]) -> list[RequestOutput]:
        """Apply a step's updates; the outputs of the groups that moved (each sequence listed once)."""
        moved: dict[str, list[int]] = {}
        failed: dict[str, BaseException] = {}
        for update in updates:
            group_id = update.request.group_id
            if group_id in failed:
                continue
            try:
                index = self._apply(update)
            except Exception as e:  # this request's own output processing
                failed[group_id] = e
                moved.pop(group_id, None)
                continue
            indices = moved.setdefault(group_id, [])
            if index is not None and index not in indices:  # speculation: several tokens, one entry
                indices.append(index)
        outputs = []
        for group_id, indices in moved.items():
            state = self.states.get(group_id)
            try:
                outputs.append(self._make_output(group_id, indices))
            except Exception as e:
                failed[group_id] = e
                if state is not None:  # the error output is built from it, even if it was let go already
                    self.states[group_id] = state
        if failed:
            outputs += self._fail_groups(failed)
        return [output for output in outputs if output is not None]

    def _fail_groups(self, failed: dict[str, BaseException]) -> list[RequestOutput]:
        """Finish requests whose output processing raised (the core checks its invariants after)."""
        for group_id, error in failed.items():
            logger.error("request %s failed in output processing", group_id, exc_info=error)
        try:
            self.core.fail_groups(list(failed))
        except Exception:
            logger.critical("the engine's state cannot be trusted after a request failed: every request fails")
            raise
        errors = [self._error_output(group_id, error) for group_id, error in failed.items()]
        return [output for output in errors if output is not None]

    def _error_output(self, group_id: str, error: BaseException | None) -> RequestOutput | None:
        """The finished output of a group the engine failed: its n sequences empty, finish_reason "error",
        and a message safe to show its client (the exception's type, never its text)."""
        state = self.states.pop(group_id, None)
        message = f"the engine failed this request: {type(error).__name__}"
        if state is None:  # not one of ours (beam search drives the core itself) or already reported
            return None
        self._group_ids.pop(state.request_id, None)
        completions = [CompletionOutput(i, "", [], finish_reason=RequestStatus.FINISHED_ERROR.value)
                       for i in range(state.params.n)]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, True,
                             state.prompt_logprobs, state.num_cached_tokens, error=message)

    # ---- per-sequence bookkeeping ------------------------------------------------------
    def _apply(self, update: StepUpdate) -> int | None:
        request, state = update.request, self.states[update.request.group_id]
        if request.status == RequestStatus.FINISHED_ERROR and update.token_id is None:
            self._fail(state, request.error or "the engine failed this request")
            return None
        if update.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, *update.prompt_logprobs)
        if update.pooled is not None:
            state.pooled = update.pooled
            state.num_cached_tokens = max(0, request.num_cached_tokens)
            return request.index
        if update.token_id is None:
            return None
        seq = state.sequences.get(request.index)
        if seq is None:
            seq = state.sequences[request.index] = Sequence(
                IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params),
                CompletionOutput(request.index, "", [], 0.0 if request.params.needs_logprobs else None,
                                 [] if request.params.logprobs is not None else None))
            state.num_cached_tokens = max(0, request.num_cached_tokens)
        if seq.stopped:
            return None
        self._add_token(request, seq, update.token_id, update.logprobs)
        return request.index

    def _add_token(self, request: Request, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> None:
        c = seq.completion
        c.token_ids.append(token_id)
        c.delta_token_ids.append(token_id)
        if logprobs is not None:
            c.cumulative_logprob += logprobs.logprob
            if c.logprobs is not None:
                entry = self._position_logprobs(logprobs)
                c.logprobs.append(entry)
                c.delta_logprobs.append(entry)
        is_last = len(c.token_ids) == request.num_output_tokens  # speculation may add several per step
        if not (is_last and self._text_hidden(request, token_id)):
            stop = seq.detokenizer.add_tokens([token_id])
            if stop is not None:
                seq.stopped = True
                if not request.status.finished:
                    self.core.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        c.text = seq.detokenizer.text
        c.finish_reason, c.stop_reason = request.finish_reason, request.stop_reason
        c.delta_text += seq.detokenizer.take_delta(request.status.finished)

    @staticmethod
    def _text_hidden(request: Request, token_id: int) -> bool:
        """The finishing EOS never shows as text; a stop token only with include_stop_str_in_output."""
        if request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None:
            return True
        return request.stop_reason == token_id and not request.params.include_stop_str_in_output

    def _position_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, self.decode_token(lp.token_id))}
        for rank, (token_id, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            entry.setdefault(token_id, Logprob(value, rank, self.decode_token(token_id)))
        return entry

    def _add_prompt_logprobs(self, state: RequestState, first: int, entries: list[TokenLogprobs]) -> None:
        # A preempted request recomputes its prompt: keep only positions not seen yet.
        have = len(state.prompt_logprobs) - 1
        for offset, lp in enumerate(entries):
            if first + offset >= have:
                state.prompt_logprobs.append(self._position_logprobs(lp))

    def _fail(self, state: RequestState, error: str) -> None:
        """The core failed one sequence of the group: the group ends with ``error`` (siblings finished too)."""
        state.error = error
        ids = [child_request_id(state.group_id, i) for i in range(state.params.best_of)]
        self.core.finish_requests(ids, RequestStatus.FINISHED_ERROR)

    # ---- outputs ---------------------------------------------------------------------
    def _make_output(self, group_id: str, moved: list[int]) -> RequestOutput | None:
        """The group's output for this step per its output kind; None when FINAL_ONLY has nothing yet."""
        state = self.states[group_id]
        kind = state.params.output_kind
        finished = state.finished
        if state.pooling is not None:
            return self._pooling_output(state) if finished else None
        if finished:
            del self.states[group_id], self._group_ids[state.request_id]
            completions = self._final(state)
        elif kind == RequestOutputKind.FINAL_ONLY:
            return None  # deltas keep accumulating until the final output
        else:
            completions = [_take(state.sequences[i].completion, kind) for i in moved]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             state.prompt_logprobs, state.num_cached_tokens, state.error)

    def _pooling_output(self, state: RequestState) -> RequestOutput:
        """A finished pooling request's one output: no sequences, its vector in ``pooling``."""
        del self.states[state.group_id], self._group_ids[state.request_id]
        pooled = PoolingOutput(state.pooled) if state.pooled is not None else None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [], True, None,
                             state.num_cached_tokens, state.error, pooled)

    @staticmethod
    def _final(state: RequestState) -> list[CompletionOutput]:
        """All n sequences, or the n best of best_of by cumulative logprob, as indices 0..n-1 (DELTA: what
        each added since its last output). The state is dropped, so its objects are handed over, not copied."""
        kind = state.params.output_kind
        if state.error is not None:  # every sequence as far as it got, the missing ones empty
            sequences = [state.sequences[i].completion if i in state.sequences else CompletionOutput(i, "", [])
                         for i in range(state.params.n)]
            for c in sequences:
                c.finish_reason, c.stop_reason = RequestStatus.FINISHED_ERROR.value, None
        else:
            sequences = [state.sequences[i].completion for i in sorted(state.sequences)]
            if state.params.best_of > state.params.n:  # never DELTA (SamplingParams refuses it)
                sequences = sorted(sequences, key=lambda c: c.cumulative_logprob, reverse=True)[:state.params.n]
        outputs = []
        for index, c in enumerate(sequences):
            out = _take(c, kind) if kind == RequestOutputKind.DELTA else c
            out.index = index
            outputs.append(out)
        return outputs


def _take(c: CompletionOutput, kind: RequestOutputKind) -> CompletionOutput:
    """This step's output of a running sequence, and its delta fields start over.

    CUMULATIVE: a copy the caller may keep while the engine goes on appending. DELTA: only the step's
    text, token ids and logprobs (the delta lists themselves, handed over), O(step) not O(sequence).
    """
    if kind == RequestOutputKind.DELTA:
        logprobs = c.delta_logprobs if c.logprobs is not None else None
        out = CompletionOutput(c.index, c.delta_text, c.delta_token_ids, c.cumulative_logprob, logprobs,
                               c.finish_reason, c.stop_reason, c.delta_text, c.delta_token_ids, c.delta_logprobs)
    else:
        out = CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                               list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason,
                               c.delta_text, list(c.delta_token_ids), list(c.delta_logprobs))
    c.delta_text, c.delta_token_ids, c.delta_logprobs = "", [], []
    return out


def _eos_token_ids(tokenizer, model_path: Path, model_config: ModelConfig) -> frozenset[int]:
    ids = set()
    for source in (tokenizer.eos_token_id, model_config.eos_token_id, _generation_eos(model_path)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)


def _generation_eos(model_path: Path):
    path = model_path / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
