"""The application's arguments: one pydantic model for ``serve run ... key=value``, a Serve config's ``args``
and a KubeRay ``serveConfigV2``.

Engine fields carry ``EngineConfig``'s names and defaults (vLLM's names), so ``max_num_seqs=64`` means the
same thing here as ``--max-num-seqs 64`` does to ``paged-runtime serve``. The other fields size and place
the Serve deployments. Values from the command line arrive as strings; pydantic converts them
(``"64"`` -> 64, ``"false"`` -> False) and ``kv_cache_memory`` also takes ``"512MiB"`` or ``"2GiB"``.

This module must stay importable without torch: the driver and the ingress replicas import it.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class AppArgs(BaseModel):
    """Everything ``rayserve_adapter:app`` accepts; unknown names are refused (a typo must not pass silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # ---- the engine (EngineConfig's names) --------------------------------------------------
    model: str | None = None  # a Hugging Face folder or .gguf file; None: the embedded SmolLM2-135M-Instruct
    served_model_name: str | list[str] | None = None
    tokenizer: str | None = None
    dtype: Literal["auto", "bfloat16", "float16", "half", "float32", "float"] = "auto"
    # weights quantized at load or the checkpoint's format (--quantization)
    quantization: Literal["none", "int8", "int4", "fp8", "gguf", "gptq", "awq", "compressed-tensors"] | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "int8"] = "auto"  # the paged cache's elements
    device: str = "auto"
    max_model_len: int | None = Field(default=None, ge=2)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1)
    kv_cache_memory: int | None = Field(default=None, ge=1)  # bytes; None: a share of free memory
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    seed: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    tensor_parallel_size: int = Field(default=1, ge=1)  # ranks per pipeline stage (one GPU each, one node)
    pipeline_parallel_size: int = Field(default=1, ge=1)  # stages (they may span nodes)
    enforce_eager: bool = False  # plain PyTorch: no CUDA graphs, no compiled CPU decode kernels
    debug_checks: bool = False
    async_scheduling: bool | None = None  # schedule step N+1 while step N runs; None: on for CUDA, off on the CPU
    # vLLM's {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}, or its JSON text
    # (as `serve run ... speculative_config='{...}'` passes it); checked when a replica builds its engine.
    speculative_config: dict[str, Any] | str | None = None

    # ---- HTTP -------------------------------------------------------------------------------
    api_key: str | None = None  # require "Authorization: Bearer <key>" on /v1 routes
    max_waiting_requests: int | None = Field(default=None, ge=1)  # the engine's own queue bound (503)
    # on shutdown, how long in-flight requests get to finish (Serve's graceful_shutdown_timeout_s follows it)
    shutdown_timeout: float = Field(default=30.0, ge=0)
    # the HTTP edge, as `paged-runtime serve`'s flags of the same names (413 / 400 beyond, CORS for these only)
    max_request_body_bytes: int = Field(default=16 * 2**20, ge=1)
    max_prompts_per_request: int = Field(default=256, ge=1)
    allowed_origins: list[str] | None = None
    metrics_require_api_key: bool = False
    # The chat route's tool calling and reasoning (paged-runtime serve's flags of the same names)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    # ---- Serve: replicas, placement, admission ----------------------------------------------
    num_replicas: int = Field(default=1, ge=1)
    autoscaling_config: dict[str, Any] | None = None  # Ray's AutoscalingConfig fields; our policy by default
    num_cpus: float = Field(default=1.0, ge=0)  # per replica (its process; the step loop is one thread)
    num_gpus: float = Field(default=0.0, ge=0)  # per replica; with several ranks, per rank (0: one each)
    # How a replica's bundles (one per rank) are placed; None: STRICT_PACK (one node) with one pipeline
    # stage, PACK (as few nodes as fit) with several. See builder.placement_options.
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] | None = None
    max_ongoing_requests: int | None = Field(default=None, ge=1)  # None: max_num_seqs
    max_queued_requests: int = -1  # per handle; beyond it, 429 with Retry-After. -1: unbounded
    retry_after_s: float = Field(default=1.0, ge=0)
    prefix_aware_routing: bool = True  # multi-replica mode only
    routing_stats_period_s: float = Field(default=2.0, gt=0)

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip().isdigit():
            from paged_runtime.entrypoints.cli import parse_bytes  # lazily: it imports torch
            try:
                return parse_bytes(value)
            except Exception as e:  # argparse's error type: say it the pydantic way
                raise ValueError(str(e)) from None
        return value

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_bound(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("max_queued_requests must be -1 (unbounded) or a positive integer")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AppArgs:
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        self.chat_options()  # an unknown parser name or auto tool choice without a parser fails here, at build
        return self

    # ---- derived ------------------------------------------------------------------------------
    @property
    def served_model_names(self) -> list[str]:
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        if self.served_model_name:
            return list(self.served_model_name)
        if self.model is not None:
            return [self.model]
        return ["SmolLM2-135M-Instruct"]  # paged_runtime's DEFAULT_MODEL_NAME, without importing torch

    @property
    def world_size(self) -> int:
        """Ranks per replica: one Ray actor (and device) each."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def replica_max_ongoing_requests(self) -> int:
        """Serve's per-replica concurrency: the engine's batch, so Serve never starves or floods it."""
        return self.max_ongoing_requests or self.max_num_seqs

    @property
    def max_model_replicas(self) -> int:
        if self.autoscaling_config is None:
            return self.num_replicas
        return int(self.autoscaling_config.get("max_replicas", 1))

    @property
    def multi_replica(self) -> bool:
        """Two deployments (ingress + model, prefix-aware routing) once there can be more than one replica."""
        return self.max_model_replicas > 1

    def chat_options(self):
        from paged_runtime.entrypoints.openai.serving_chat import ChatOptions
        return ChatOptions(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser)

    def engine_config(self):
        """The ``EngineConfig`` for one replica's engine (imports the runtime: call it on the replica)."""
        from paged_runtime.config import EngineConfig
        overrides: dict[str, Any] = {"served_model_name": self.served_model_names[0]}
        if self.world_size > 1:
            # The ranks are Ray actors in the replica's placement group. The replica holds no GPU itself, so
            # "auto" would mean the CPU there (dtype, scheduling): the ranks' GPUs decide.
            overrides["distributed_executor_backend"] = "ray"
            if self.device == "auto":
                overrides["device"] = "cuda"
        return EngineConfig.from_attributes(self, **overrides)


def parse_args(args: AppArgs | dict[str, Any] | None) -> AppArgs:
    return args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
