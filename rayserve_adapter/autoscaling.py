"""Autoscaling on what the engines report, not on request counts.

Each model replica's ``record_autoscaling_stats`` reports its engine's waiting
requests and KV-cache usage under the keys below; Serve aggregates them over
``look_back_period_s`` into ``ctx.aggregated_metrics[key][replica_id]``. The
policy turns them into a replica count. Serve's wrapper then applies
``upscale_delay_s`` / ``downscale_delay_s``, the scaling factors and the
min/max bounds, so the policy only says where the fleet should be.

Why these signals: with ``max_ongoing_requests`` equal to the engine's
``max_num_seqs``, a busy replica's batch is full and the overflow waits in
Serve's handles (``ctx.total_queued_requests``) or in the engine's queue;
both are waiting requests. KV usage says how close the replicas are to
preempting. A request count says neither: 64 short requests and 64 long
ones cost very different amounts.

Pickled by value into the Serve controller: this module imports nothing but
the standard library.
"""
from __future__ import annotations

import math
from typing import Any

NUM_WAITING = "num_waiting"  # requests in the engine's queue
KV_CACHE_USAGE = "kv_cache_usage"  # 0..1, blocks held by requests
NUM_RUNNING = "num_running"  # reported for dashboards; not a scaling signal

POLICY_PATH = "rayserve_adapter.autoscaling:EngineAutoscalingPolicy"


class EngineAutoscalingPolicy:
    """``pressure = max(waiting per replica / target_num_waiting_per_replica, mean KV usage / target_kv_cache_usage)``.

    - pressure > 1: scale out in proportion, to ``ceil(replicas * pressure)``;
    - nothing waits and mean KV usage is at most ``idle_kv_cache_usage``: one replica fewer
      (Serve's downscale delay makes that "idle for a while", and min_replicas bounds it);
    - otherwise hold. Replicas that have not reported yet give no evidence, so the policy holds
      unless requests are already queued at the handles.
    """

    def __init__(self, target_num_waiting_per_replica: float = 2.0, target_kv_cache_usage: float = 0.8,
                 idle_kv_cache_usage: float = 0.2) -> None:
        if target_num_waiting_per_replica <= 0 or not 0 < target_kv_cache_usage <= 1:
            raise ValueError("targets must be positive (target_kv_cache_usage in (0, 1])")
        if not 0 <= idle_kv_cache_usage < target_kv_cache_usage:
            raise ValueError("idle_kv_cache_usage must be in [0, target_kv_cache_usage)")
        self.target_num_waiting_per_replica = target_num_waiting_per_replica
        self.target_kv_cache_usage = target_kv_cache_usage
        self.idle_kv_cache_usage = idle_kv_cache_usage

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """(desired replicas, policy state) for one autoscaling tick; ``ctx`` is Serve's AutoscalingContext."""
        num_replicas = ctx.current_num_replicas
        if num_replicas == 0:
            return ctx.target_num_replicas, {}  # Serve's cold-start path scales up from zero on queued requests
        metrics = ctx.aggregated_metrics or {}
        kv_usages = list(metrics.get(KV_CACHE_USAGE, {}).values())
        num_waiting = sum(metrics.get(NUM_WAITING, {}).values()) + (ctx.total_queued_requests or 0)
        mean_kv = sum(kv_usages) / len(kv_usages) if kv_usages else 0.0
        pressure = max(num_waiting / (num_replicas * self.target_num_waiting_per_replica),
                       mean_kv / self.target_kv_cache_usage)
        state = {"pressure": pressure, "num_waiting": num_waiting, "mean_kv_cache_usage": mean_kv}
        if pressure > 1:
            return math.ceil(num_replicas * pressure), state
        if kv_usages and num_waiting == 0 and mean_kv <= self.idle_kv_cache_usage:
            return num_replicas - 1, state
        return num_replicas, state
