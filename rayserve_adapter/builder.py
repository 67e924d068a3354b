"""The application builder behind ``serve run rayserve_adapter:app [key=value ...]``.

One replica (the default): the model deployment is the application's ingress
and serves the OpenAI routes itself. More than one (``num_replicas > 1``, or
``autoscaling_config`` with ``max_replicas > 1``): an ingress deployment
forwards to the model deployment, routed by the replicas' KV-cache events
(``request_router``: or prefix affinity, or Serve's power of two choices).
Several models (``models=[A, B]`` or ``models_dir``): one model deployment per
model (``PagedRuntimeServer-<name>``, each with the replicas, routing and
placement above), behind one ingress that picks the deployment by the
request's ``model``. With ``enable_lora``, the ingress also routes requests
naming LoRA adapters (``lora.py``): to their base model's deployment, and
there to replicas that already hold the adapter.

Deployment options derived from the arguments:

- ``max_ongoing_requests`` = the engine's ``max_num_seqs`` (Serve's default
  of 5 would starve continuous batching; more would only queue inside the
  engine, where Serve can neither see nor reroute the overflow);
- ``max_queued_requests`` with a 429 + ``Retry-After`` backpressure response;
- ``autoscaling_config`` with ``EngineAutoscalingPolicy`` unless it names a policy;
- ``graceful_shutdown_timeout_s`` = ``shutdown_timeout``: Serve stops routing to a stopping model
  replica, waits that long for its requests, then kills it; the ingress gets a margin more, so it
  can end the responses of a killed replica with an error (``deployment.py``);
- ``ray_actor_options`` / placement-group bundles from ``num_cpus``, ``num_gpus``,
  ``tensor_parallel_size``, ``pipeline_parallel_size`` and ``placement_strategy``.

A Serve config's ``deployments:`` entries (by the names in ``deployment.py``)
still override any of these.
"""
# No `from __future__ import annotations` here: Serve reads the builder's parameter annotation as a class
# to validate `args` into an AppArgs.
from typing import Any, Dict, List, Optional

from ray.serve import Application

from rayserve_adapter.args import AppArgs, parse_args
from rayserve_adapter.autoscaling import POLICY_PATH
from rayserve_adapter.deployment import (INGRESS_DEPLOYMENT, MODEL_DEPLOYMENT, PagedRuntimeBackend, PagedRuntimeIngress,
                                         PagedRuntimeServer)
from rayserve_adapter.lora import AdapterNames

ROUTER_PATH = "rayserve_adapter.router:PrefixAffinityRouter"
KV_ROUTER_PATH = "rayserve_adapter.kv_router:KVEventRouter"
ROUTERS = {"kv_events": KV_ROUTER_PATH, "prefix": ROUTER_PATH}  # power_of_two: Serve's own
INGRESS_HEADROOM = 64  # requests beyond the model's capacity the ingress holds: /health, /metrics, the queue
SHUTDOWN_MARGIN_S = 5.0  # the ingress outlives the model replicas' grace by this much (their last error events)


def app(args: AppArgs) -> Application:
    """The Serve application for ``args`` (a dict is accepted too)."""
    args = parse_args(args)
    if args.multi_model:
        models = {spec.name: PagedRuntimeBackend.options(**model_options(args.for_model(spec), spec.name))
                  .bind(args.for_model(spec)) for spec in args.model_specs()}
        return PagedRuntimeIngress.options(**ingress_options(args, len(models))).bind(
            models, args.max_request_body_bytes, args.kv_event_routing, args.server_config(),
            lora=adapter_names(args, list(models)))
    if not args.multi_replica:
        return PagedRuntimeServer.options(**model_options(args)).bind(args)
    model = PagedRuntimeBackend.options(**model_options(args)).bind(args)
    return PagedRuntimeIngress.options(**ingress_options(args)).bind(
        model, args.max_request_body_bytes, args.kv_event_routing, lora=adapter_names(args, args.served_model_names))


def adapter_names(args: AppArgs, base_names: List[str]) -> Optional[AdapterNames]:
    """What the ingress needs to route LoRA requests (``base_names``: the served names of the base models, the
    first the default base); None without ``enable_lora``."""
    if not args.enable_lora:
        return None
    return AdapterNames(tuple(base_names), args.dynamic_lora_loading_path)


def model_options(args: AppArgs, model_name: Optional[str] = None) -> Dict[str, Any]:
    """A model deployment's options; ``model_name``: one model of several (its deployment is named after it)."""
    options: Dict[str, Any] = {
        "name": MODEL_DEPLOYMENT if model_name is None else f"{MODEL_DEPLOYMENT}-{model_name}",
        "max_ongoing_requests": args.replica_max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": args.retry_after_s},
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        **placement_options(args),
    }
    if args.autoscaling_config is not None:
        options["autoscaling_config"] = {"policy": {"policy_function": POLICY_PATH}, **args.autoscaling_config}
    else:
        options["num_replicas"] = args.num_replicas
    if args.multi_replica:  # several replicas of this model: routed among them by prefix or KV events
        router: Dict[str, Any] = {"request_routing_stats_period_s": args.routing_stats_period_s}
        if args.request_router in ROUTERS:
            router["request_router_class"] = ROUTERS[args.request_router]
        options["request_router_config"] = router
    return options


def ingress_options(args: AppArgs, num_models: int = 1) -> Dict[str, Any]:
    """One light replica: no GPU, and room for every request the model replicas (of every model) can run or
    queue."""
    capacity = (args.replica_max_ongoing_requests * args.max_model_replicas + max(args.max_queued_requests, 0)) \
        * num_models
    return {"name": INGRESS_DEPLOYMENT, "num_replicas": 1, "ray_actor_options": {"num_cpus": args.num_cpus},
            "max_ongoing_requests": capacity + INGRESS_HEADROOM,
            "backpressure_config": {"status_code": 429, "retry_after_s": args.retry_after_s},
            "graceful_shutdown_timeout_s": args.shutdown_timeout + SHUTDOWN_MARGIN_S}


def placement_options(args: AppArgs) -> Dict[str, Any]:
    """``ray_actor_options``, plus one placement-group bundle per rank when a replica has several ranks.

    Each rank is a Ray actor (``paged_runtime/executor/ray_executor.py``) that takes bundle ``rank`` of the
    replica's placement group. Serve puts the replica actor itself in bundle 0, so bundle 0 holds the
    replica's CPUs and rank 0's GPU: the replica (scheduler, tokenizer, HTTP) needs no GPU of its own, so
    tensor x pipeline GPUs serve the replica, none idle, and the replica shares a node with stage 0.

    Strategy: STRICT_PACK (one node: tensor parallelism's all-reduces want NVLink, not the network) with
    one pipeline stage; PACK with several, so stages may span nodes when no node has every GPU. PACK
    fills nodes in bundle order, so a stage's ranks (consecutive bundles) stay together on nodes whose GPU
    count is a multiple of the tensor-parallel size. ``placement_strategy`` overrides either.
    On the CPU (``device: cpu``, tests) a rank's bundle reserves one CPU instead of a GPU.
    """
    actor: Dict[str, Any] = {"num_cpus": args.num_cpus}
    if args.world_size == 1:
        if args.num_gpus:
            actor["num_gpus"] = args.num_gpus
        return {"ray_actor_options": actor}
    rank: Dict[str, float] = {"CPU": 1.0} if args.device == "cpu" else {"GPU": args.num_gpus or 1}
    first = dict(rank)
    if args.num_cpus:
        first["CPU"] = first.get("CPU", 0) + args.num_cpus
    bundles: List[Dict[str, float]] = [first] + [dict(rank) for _ in range(args.world_size - 1)]
    strategy = args.placement_strategy or ("STRICT_PACK" if args.pipeline_parallel_size == 1 else "PACK")
    return {"ray_actor_options": actor, "placement_group_bundles": bundles, "placement_group_strategy": strategy}


__all__ = ["app", "model_options", "ingress_options", "placement_options", "adapter_names", "ROUTER_PATH",
           "KV_ROUTER_PATH", "SHUTDOWN_MARGIN_S"]
