"""The declared engine API: all that the OpenAI routes, the CLI and the KServe and Ray Serve adapters use.

``EngineClient`` is a structural protocol (``AsyncEngine`` implements it); a front end that holds one
reaches nothing else, so the engine's insides (``LLMEngine``, its core, scheduler and processor) can
change without touching a route or an adapter. The types a caller meets on the way (the output
stream, the stats snapshot, the two engine errors) are declared here too, and nothing here imports
torch.

Threading: every member may be used from any thread. ``add_request`` and ``generate`` bind the running
event loop (call them from a coroutine). ``tokenizer`` and ``process`` are the caller's side's own
(a Hugging Face fast tokenizer must not be used from two threads at once; the engine detokenizes with
another copy), so tokenizing or validating ahead never waits on a step.

Errors: a client's mistake raises ``ParameterError`` (a ``ValueError`` naming the field in ``param``)
from ``process`` / ``add_request``; a full waiting queue ``EngineOverloadedError``; an engine that
cannot serve ``EngineDeadError``; a request the engine had to fail alone ends its stream with
``RequestFailedError``.

``LLM`` (offline, synchronous) uses ``LLMEngine``'s declared methods instead: there is no event loop to
hand outputs to, and no second thread to hand work over to.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from paged_runtime.config import EngineConfig
    from paged_runtime.engine.processor import ProcessedPrompt, PromptType
    from paged_runtime.lora.request import LoRARequest
    from paged_runtime.outputs import RequestOutput
    from paged_runtime.pooling_params import PoolingParams
    from paged_runtime.sampling_params import SamplingParams


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry after ``retry_after`` seconds. Admitted requests are unaffected."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The step loop has stopped (a step raised, or the engine was shut down); the engine cannot serve."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (``RequestOutput.error``); the engine and other requests go on."""


@dataclass(slots=True)
class EngineStats:
    """A snapshot for health checks, autoscalers and routers (taken after each pass of the step loop)."""
    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # since start
    num_prefix_queries: int = 0  # tokens, since start
    num_prefix_hits: int = 0


class RequestStream(Protocol):
    """The outputs of one request, in order; iteration ends after the output with ``finished`` set, or
    with ``RequestFailedError`` / ``EngineDeadError``.

    A reader that falls behind gets the outputs it missed merged into one (text and deltas joined per
    sequence, as ``params.output_kind`` says), so a slow reader costs memory O(its request's length).
    Leaving the iteration early, or calling ``abort()``, aborts this stream's own request (idempotent, any
    thread), never a later request that reuses its id. Outputs carry the caller's ``request_id``.
    """
    request_id: str
    finished: bool

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """What a front end may ask of an engine (see the module docstring for threads and errors)."""

    # ---- the model ---------------------------------------------------------------------------
    config: EngineConfig  # as built: model, served_model_name, scheduling_policy, ...
    max_model_len: int
    hidden_size: int  # a pooling model's vector size
    tokenizer: object  # the caller's side's own copy (chat templates, /tokenize, /detokenize)
    # SamplingParams field -> default for requests that leave it unset (the model's generation_config.json,
    # see engine/generation_config.py); "max_tokens" also caps what a request asks for. Empty: none.
    default_sampling: dict[str, Any]

    @property
    def model_root(self) -> str:
        """The resolved model folder (what /v1/models reports as ``root``)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """The batch limit that requests' n / best_of are checked against now."""
        ...

    # ---- requests ----------------------------------------------------------------------------
    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and validate ahead of ``add_request`` (raises ``ParameterError``); never waits on a step."""
        ...

    def pooling_params(self, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        """A pooling request's parameters on this engine (``config.runner == "pooling"``): its pooling type,
        ``dimensions`` (``ParameterError`` beyond ``hidden_size``), ``normalize`` (None: the engine's setting)."""
        ...

    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    pooling: PoolingParams | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request and return its stream, or raise before anything is queued. ``pooling``: a pooling
        request (a pooling engine takes only these, a generating one none): one finished output whose
        ``pooling`` holds its vector. ``lora_request``: the adapter it runs with (``add_lora`` it first to hear
        at once why an adapter cannot run; else the request fails with that reason)."""
        ...

    def generate(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, cache_salt: str | None = None,
                 pooling: PoolingParams | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving the iteration early aborts it."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort the live request with this id (unknown ids are ignored); its stream ends with finish_reason
        "abort"."""
        ...

    # ---- adapters (--enable-lora) ---------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter on every worker (``LoRAError`` says why it cannot run); a no-op for one
        already held."""
        ...

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter once the requests running with it finish; False if it was not held."""
        ...

    async def list_loras(self) -> set[int]:
        """The ids of the adapters held."""
        ...

    # ---- state and control -------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """The latest snapshot (for autoscaling and routing); Prometheus metrics go through stat loggers."""
        ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def kv_events_endpoint(self) -> str | None:
        """The address the KV-cache events' PUB socket bound (its port chosen when the config said ``*``), for
        subscribers to connect to; None when events are off or the socket connects out instead."""
        ...

    @property
    def cpu_kernels(self) -> dict | None:
        """The compiled CPU kernels the engine's (driver) worker runs, as /version shows them: ``{"isa": the
        cpu_isa built for, "variants": {kernel family: path}}`` (``kernels/cpu.info()``); None where it runs
        none."""
        ...

    def check_health(self) -> None:
        """Raises ``EngineDeadError`` unless the engine serves."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix before the next step (blocks in use keep their KV)."""
        ...

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Change the batch limit live; lowering it preempts nobody. The KV cache keeps its size."""
        ...

    def set_max_waiting_requests(self, limit: int | None) -> None:
        """Change the waiting-queue bound live (None: unbounded); beyond it ``add_request`` is refused."""
        ...

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine; requests in flight fail with ``EngineDeadError``. Idempotent."""
        ...
