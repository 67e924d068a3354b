"""The application builder behind ``serve run rayserve_adapter:app [key=value ...]``.

One replica (the default): the model deployment is the application's ingress
and serves the OpenAI routes itself. More than one (``num_replicas > 1``, or
``autoscaling_config`` with ``max_replicas > 1``): an ingress deployment
forwards to the model deployment, routed prefix-aware.

Deployment options derived from the arguments:

- ``max_ongoing_requests`` = the engine's ``max_num_seqs`` (Serve's default
  of 5 would starve continuous batching; more would only queue inside the
  engine, where Serve can neither see nor reroute the overflow);
- ``max_queued_requests`` with a 429 + ``Retry-After`` backpressure response;
- ``autoscaling_config`` with ``EngineAutoscalingPolicy`` unless it names a policy;
- ``graceful_shutdown_timeout_s`` = ``shutdown_timeout``: Serve stops routing to a stopping model
  replica, waits that long for its requests, then kills it; the ingress gets a margin more, so it
  can end the responses of a killed replica with an error (``deployment.py``);
- ``ray_actor_options`` / placement-group bundles from ``num_cpus``,
  ``num_gpus`` and ``tensor_parallel_size``.

A Serve config's ``deployments:`` entries (by the names in ``deployment.py``)
still override any of these.
"""
# No `from __future__ import annotations` here: Serve reads the builder's parameter annotation as a class
# to validate `args` into an AppArgs.
from typing import Any, Dict, List

from ray.serve import Application

from rayserve_adapter.args import AppArgs, parse_args
from rayserve_adapter.autoscaling import POLICY_PATH
from rayserve_adapter.deployment import (INGRESS_DEPLOYMENT, MODEL_DEPLOYMENT, PagedRuntimeBackend, PagedRuntimeIngress,
                                         PagedRuntimeServer)

ROUTER_PATH = "rayserve_adapter.router:PrefixAffinityRouter"
INGRESS_HEADROOM = 64  # requests beyond the model's capacity the ingress holds: /health, /metrics, the queue
SHUTDOWN_MARGIN_S = 5.0  # the ingress outlives the model replicas' grace by this much (their last error events)


def app(args: AppArgs) -> Application:
    """The Serve application for ``args`` (a dict is accepted too)."""
    args = parse_args(args)
    if not args.multi_replica:
        return PagedRuntimeServer.options(**model_options(args)).bind(args)
    model = PagedRuntimeBackend.options(**model_options(args)).bind(args)
    return PagedRuntimeIngress.options(**ingress_options(args)).bind(model, args.max_request_body_bytes)


def model_options(args: AppArgs) -> Dict[str, Any]:
    options: Dict[str, Any] = {
        "name": MODEL_DEPLOYMENT,
        "max_ongoing_requests": args.replica_max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": args.retry_after_s},
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        **placement_options(args.num_cpus, args.num_gpus, args.tensor_parallel_size),
    }
    if args.autoscaling_config is not None:
        options["autoscaling_config"] = {"policy": {"policy_function": POLICY_PATH}, **args.autoscaling_config}
    else:
        options["num_replicas"] = args.num_replicas
    if args.multi_replica:
        router: Dict[str, Any] = {"request_routing_stats_period_s": args.routing_stats_period_s}
        if args.prefix_aware_routing:
            router["request_router_class"] = ROUTER_PATH
        options["request_router_config"] = router
    return options


def ingress_options(args: AppArgs) -> Dict[str, Any]:
    """One light replica: no GPU, and room for every request the model replicas can run or queue."""
    capacity = args.replica_max_ongoing_requests * args.max_model_replicas + max(args.max_queued_requests, 0)
    return {"name": INGRESS_DEPLOYMENT, "num_replicas": 1, "ray_actor_options": {"num_cpus": args.num_cpus},
            "max_ongoing_requests": capacity + INGRESS_HEADROOM,
            "backpressure_config": {"status_code": 429, "retry_after_s": args.retry_after_s},
            "graceful_shutdown_timeout_s": args.shutdown_timeout + SHUTDOWN_MARGIN_S}


def placement_options(num_cpus: float, num_gpus: float, tensor_parallel_size: int) -> Dict[str, Any]:
    """``ray_actor_options``, plus one placement-group bundle per GPU worker when a replica spans several GPUs.

    Serve places the replica actor in the first bundle (so it holds the replica's CPUs and the first
    GPU); the other bundles are for the workers, packed onto one node (STRICT_PACK: tensor parallelism
    wants NVLink, not the network).
    """
    actor: Dict[str, Any] = {"num_cpus": num_cpus}
    if tensor_parallel_size == 1:
        if num_gpus:
            actor["num_gpus"] = num_gpus
        return {"ray_actor_options": actor}
    gpus_per_worker = num_gpus or 1
    first: Dict[str, float] = {"GPU": gpus_per_worker, **({"CPU": num_cpus} if num_cpus else {})}
    bundles: List[Dict[str, float]] = [first] + [{"GPU": gpus_per_worker}] * (tensor_parallel_size - 1)
    return {"ray_actor_options": {**actor, "num_gpus": gpus_per_worker}, "placement_group_bundles": bundles,
            "placement_group_strategy": "STRICT_PACK"}


__all__ = ["app", "model_options", "ingress_options", "placement_options", "ROUTER_PATH", "SHUTDOWN_MARGIN_S"]
