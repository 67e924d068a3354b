"""Executors: how the engine drives its workers (``base.py``), in-process, as local processes or Ray actors."""
from __future__ import annotations

import torch

from paged_runtime.config import EngineConfig
from paged_runtime.executor.base import Executor, ExecutorDead, UniProcExecutor
from paged_runtime.models.config import ModelConfig
from paged_runtime.worker.worker import WorkerSpec


def make_executor(spec: WorkerSpec) -> Executor:
    """One worker in-process for one device; else the configured backend, one worker per device."""
    c = spec.config
    backend = c.distributed_executor_backend or ("ray" if _inside_ray() else "mp")
    if c.world_size == 1 and c.distributed_executor_backend is None:
        executor = UniProcExecutor(spec)
    elif backend == "ray":
        from paged_runtime.executor.ray_executor import RayExecutor
        executor = RayExecutor(spec)
    else:
        from paged_runtime.executor.multiproc import MultiprocExecutor
        executor = MultiprocExecutor(spec)
    try:
        executor.start()
    except BaseException:
        executor.shutdown()
        raise
    return executor


def check_parallel(config: EngineConfig, model: ModelConfig, device: torch.device) -> None:
    """Refuse, before any worker starts, sizes the model or this machine cannot take, naming those that would
    work. The vocabulary need not divide: its shards are padded (as vLLM's)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if not _splits(model, tp):
        sizes = [d for d in range(1, model.num_heads + 1) if _splits(model, d)]
        raise ValueError(f"tensor_parallel_size {tp} does not split the model's {model.num_heads} attention heads, "
                         f"{model.num_kv_heads} KV heads and MLP width {model.intermediate_size} evenly; sizes that "
                         f"work: {', '.join(map(str, sizes))}")
    if pp > model.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {model.num_layers} layers: use at most "
                         f"{model.num_layers}")
    if device.type == "cuda" and config.distributed_executor_backend != "ray":
        count = torch.cuda.device_count()
        if tp * pp > count:
            raise ValueError(f"{tp * pp} ranks (tensor {tp} x pipeline {pp}) need as many devices; this machine has "
                             f"{count} CUDA devices (use --distributed-executor-backend ray to span nodes)")


def _splits(model: ModelConfig, tp: int) -> bool:
    """Each rank holds whole query heads, whole (or replicated) KV heads and an equal share of the MLP."""
    kv = model.num_kv_heads
    return (model.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
            and model.intermediate_size % tp == 0)


def _inside_ray() -> bool:
    """Whether this process is a Ray worker (a Serve replica): its devices are Ray's to place."""
    import sys
    if "ray" not in sys.modules:
        return False
    import ray
    return ray.is_initialized()


__all__ = ["Executor", "ExecutorDead", "UniProcExecutor", "check_parallel", "make_executor"]
