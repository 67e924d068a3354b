"""The application's arguments: one pydantic model for ``serve run ... key=value``, a Serve config's ``args``
and a KubeRay ``serveConfigV2``.

The runtime's fields are generated from its settings (``paged_runtime/config.py``: every field of
``EngineConfig`` and ``ServerConfig`` that the Ray front end shows), with their names, types, defaults, choices
and bounds, so ``max_num_seqs=64`` means here what ``--max-num-seqs 64`` means to ``paged-runtime serve``. The
other fields (``ServeFields``) size and place the Serve deployments. Values from the command line arrive as
strings; pydantic converts them (``"64"`` -> 64, ``"false"`` -> False) and the settings' own parsers read the
rest (``kv_cache_memory="2GiB"``).

This module must stay importable without torch: the driver and the ingress replicas import it.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from paged_runtime.config import EngineConfig, ServerConfig, served_model_names
from paged_runtime.settings import check_values, parse_text, pydantic_fields

SETTINGS = (EngineConfig, ServerConfig)


class ServeFields(BaseModel):
    """What only Ray Serve has: replicas, placement, admission. Unknown names are refused (a typo must not
    pass silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

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
    # Multi-replica mode's router: kv_events (the replicas' KV-cache events: the replica holding the longest
    # cached prefix of the request's tokens), prefix (prefix affinity by what was routed where), or
    # power_of_two (Serve's default).
    request_router: Literal["kv_events", "prefix", "power_of_two"] = "kv_events"
    routing_stats_period_s: float = Field(default=2.0, gt=0)
    # Several models in one application (with or beside models_dir): paths, each served by a model deployment
    # of its own (named by folder or file stem), behind the ingress, which routes each request by its model.
    models: list[str] | None = None

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_bound(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("max_queued_requests must be -1 (unbounded) or a positive integer")
        return value

    @model_validator(mode="before")
    @classmethod
    def _parse_settings(cls, values: Any) -> Any:
        return parse_text(SETTINGS, values)  # "2GiB", a chat template's file, ...

    @model_validator(mode="after")
    def _consistent(self) -> ServeFields:
        check_values(SETTINGS, self)  # choices and bounds, as the engine and the CLI check them
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        if self.multi_model:
            if self.model is not None or self.served_model_name:
                raise ValueError("with models / models_dir, every model is named there: leave model and "
                                 "served_model_name unset")
            self.model_specs()  # a missing path or two models of one name fail here, at build
        self.app_options()  # an unknown parser name or auto tool choice without a parser fails here, at build
        return self

    # ---- derived ------------------------------------------------------------------------------
    @property
    def served_model_names(self) -> list[str]:
        return served_model_names(self.served_model_name, self.model)

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

    @property
    def multi_model(self) -> bool:
        return bool(self.models) or self.models_dir is not None

    def model_specs(self) -> list:
        """The models of ``models`` and ``models_dir`` (``model_set.discover``; ValueError for a bad path)."""
        from paged_runtime.entrypoints.openai.model_set import discover
        return discover(self.models or [], self.models_dir)

    def for_model(self, spec) -> AppArgs:
        """These arguments for one model of several: its path, served under its name alone."""
        return self.model_copy(update={"model": spec.path, "served_model_name": [spec.name], "models": None,
                                       "models_dir": None})

    def server_config(self) -> ServerConfig:
        return ServerConfig.from_attributes(self)

    def app_options(self) -> dict[str, Any]:
        """``build_app``'s keywords (imports the routes, not torch)."""
        from paged_runtime.entrypoints.openai.api import app_options
        return app_options(self.server_config())

    @property
    def kv_event_routing(self) -> bool:
        return self.multi_replica and self.request_router == "kv_events"

    def engine_config(self, kv_events_topic: str | None = None, kv_events_host: str = "127.0.0.1") -> EngineConfig:
        """The ``EngineConfig`` for one replica's engine; with KV-event routing (and no ``kv_events_config`` of
        the user's), its events go out under ``kv_events_topic`` on a port of its own at ``kv_events_host``
        (the node's address: where Ray's own services listen, not every interface)."""
        overrides: dict[str, Any] = {}
        if self.kv_event_routing and self.kv_events_config is None:
            overrides["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": f"tcp://{kv_events_host}:*",
                                             "topic": kv_events_topic or "kv@"}
        if self.world_size > 1:
            # The ranks are Ray actors in the replica's placement group. The replica holds no GPU itself, so
            # "auto" would mean the CPU there (dtype, scheduling): the ranks' GPUs decide.
            overrides["distributed_executor_backend"] = "ray"
            if self.device == "auto":
                overrides["device"] = "cuda"
        return EngineConfig.from_attributes(self, **overrides)


AppArgs = create_model("AppArgs", __base__=ServeFields, __module__=__name__, **pydantic_fields(SETTINGS, "ray"))
AppArgs.__doc__ = "Everything ``rayserve_adapter:app`` accepts: the runtime's settings and ``ServeFields``."


def parse_args(args: AppArgs | dict[str, Any] | None) -> AppArgs:
    return args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
