"""How the engine reaches its workers: one call, every rank (or the driver alone), answers back.

The scheduler runs once, in the engine's process. An executor sends each step's ``SchedulerOutput`` to every
worker and returns the driver rank's ``RunnerOutput`` (the only rank that samples). ``UniProcExecutor`` holds
the one worker of a single-device engine in the engine's own process; ``MultiprocExecutor`` runs one process
per device on this machine and ``RayExecutor`` one Ray actor per device, on any node.

``ExecutorDead``: a worker is gone (it exited, or stopped answering after a peer failed); the engine cannot
go on and fails what it was serving. Any other exception from a call is the worker's own, as the runner
raised it.
"""
from __future__ import annotations

import dataclasses
import logging

from paged_runtime.worker.worker import Placement, Worker, WorkerInfo, WorkerSpec, driver_rank

logger = logging.getLogger(__name__)


class ExecutorDead(RuntimeError):
    """A worker died or can no longer be trusted; every later call raises this too."""


class Executor:
    """Subclasses implement ``call``; the engine uses the named methods."""
    dead: ExecutorDead | None = None
    workers = "workers"  # what the workers are, for messages ("worker processes", "worker actors")

    def __init__(self, spec: WorkerSpec) -> None:
        c = spec.config
        self.tp_size, self.pp_size, self.world_size = c.tensor_parallel_size, c.pipeline_parallel_size, c.world_size
        self.driver = driver_rank(self.tp_size, self.pp_size)

    def start(self) -> WorkerInfo:
        """Size every rank's KV cache alike (the smallest that fits everywhere); the driver's info."""
        infos = self.call("load")
        num_blocks = min(info.num_blocks for info in infos)
        self.call("init_cache", num_blocks)
        self.info = dataclasses.replace(infos[self.driver], num_blocks=num_blocks)
        return self.info

    def call(self, method: str, *args, driver_only: bool = False) -> list:
        """``Worker.method(*args)`` on every rank (or the driver alone); their results in rank order."""
        raise NotImplementedError

    def execute(self, out):
        """The driver's ``RunnerOutput`` for one step, after every rank ran it."""
        return self.call("execute", out)[self.driver]

    def retain(self, request_ids) -> None:
        self.call("retain", set(request_ids))

    def check_invariants(self, request_ids) -> None:
        self.call("check_invariants", set(request_ids))

    def use_grammars(self, grammars) -> None:
        self.call("use_grammars", grammars, driver_only=True)

    def add_lora(self, request) -> None:
        self.call("add_lora", request)

    def remove_lora(self, lora_id: int) -> None:
        self.call("remove_lora", lora_id)

    def check_health(self) -> None:
        """Raises ``ExecutorDead`` once a worker is gone (and stops the others)."""
        self.check_dead()

    def check_dead(self) -> None:
        if self.dead is not None:
            raise self.dead

    def _die(self, reason: str):
        """Give up for good: every worker stopped, this and every later call raising ``ExecutorDead``."""
        self.dead = ExecutorDead(f"one of the {self.workers} failed: {reason}; the engine cannot continue")
        logger.error("%s", self.dead)
        self.shutdown()
        raise self.dead

    def alive(self) -> bool:
        """Whether every worker still runs; only looks, so any thread may ask."""
        return True

    def shutdown(self) -> None:
        """Stop the workers; idempotent."""


class UniProcExecutor(Executor):
    """The single device's worker, in this process: a call is a method call."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.worker = Worker(spec, Placement())

    def call(self, method: str, *args, driver_only: bool = False) -> list:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.close()
