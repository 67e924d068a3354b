"""One Ray actor per rank, on any node of the cluster: the backend for ranks that span nodes, and the one a
Ray Serve replica uses (its placement group already reserved a bundle per rank).

Placement: inside a placement group (a Serve replica's), rank i runs in bundle i, so rank 0 shares bundle 0
with the replica (Serve puts the replica actor there; the replica holds that bundle's CPUs, rank 0 its
device). Elsewhere the executor reserves one bundle per rank itself (STRICT_PACK: one node when it fits) and
removes it at shutdown. On CUDA each actor takes one GPU: Ray makes it the only visible device.

Start-up: the actors start empty; rank 0's actor names the rendezvous (its node's address and a free port
there: torch.distributed's TCP store runs in rank 0), then every rank builds its ``Worker``.

Failures: a worker's exception comes back as the worker's own (``RequestSetupError`` stays one); a dead actor
(or a peer that does not answer within ``PEER_TIMEOUT_S`` after a rank failed) makes the executor give up:
``ExecutorDead``, every actor killed. Actors die with the process that created them: no orphans.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import weakref

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group, \
    remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from paged_runtime.executor.base import Executor
from paged_runtime.utils.devices import resolve_device
from paged_runtime.worker.worker import Placement, Worker, WorkerSpec

logger = logging.getLogger(__name__)

PEER_TIMEOUT_S = 30.0  # after one rank failed, how long its peers get to answer (one in a collective never will)
PLACEMENT_TIMEOUT_S = 300.0  # how long the executor's own placement group may wait for resources
HEALTH_TIMEOUT_S = 10.0
# Ray refuses all-zero bundles: a CPU rank reserves a token share (CPU ranks are for tests; they share cores).
CPU_BUNDLE = {"CPU": 0.01}
DEAD = (RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)


class RayExecutor(Executor):
    workers = "worker actors"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        c = spec.config
        _init_ray()
        device = resolve_device(c.device)
        self.group, owned = _placement_group(self.world_size, device.type == "cuda")
        gpus = [bundle.get("GPU", 0) for bundle in self.group.bundle_specs[:self.world_size]]
        # A Serve replica holds no GPU (where "auto" means the CPU): its bundles' GPUs are its ranks'.
        cuda = device.type == "cuda" or (c.device == "auto" and all(gpus))
        if cuda and not all(gpus):  # (only a group we were given: ours has a GPU per bundle on CUDA)
            raise ValueError(f"CUDA ranks need a GPU in each of their bundles; the placement group has {gpus}")
        self.actors = [
            RankActor.options(num_cpus=0, num_gpus=gpus[rank] if cuda else 0,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement_group=self.group, placement_group_bundle_index=rank)).remote()
            for rank in range(self.world_size)]
        self._finalizer = weakref.finalize(self, _stop, list(self.actors), self.group if owned else None)
        try:
            init_method = self._gather([self.actors[0].rendezvous.remote()])[0]
            self._gather([actor.build.remote(spec, Placement(rank, self.tp_size, self.pp_size, init_method))
                          for rank, actor in enumerate(self.actors)])
        except BaseException:  # a rank failed to build: no actor or group outlives the failed start
            self.shutdown()
            raise

    def call(self, method: str, *args, driver_only: bool = False) -> list:
        self.check_dead()
        ranks = [self.driver] if driver_only else range(self.world_size)
        args = [ray.put(arg) if len(ranks) > 1 else arg for arg in args]  # serialized once for every rank
        return self._gather([self.actors[rank].call.remote(method, *args) for rank in ranks])

    def _gather(self, refs: list) -> list:
        """Every answer, in order; the first worker error once all answered (or ``PEER_TIMEOUT_S`` after it)."""
        values, pending, failure, deadline = {}, list(refs), None, None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                self._die(f"{len(pending)} ranks did not answer within {PEER_TIMEOUT_S:.0f} s after one failed: "
                          f"{failure!r}")
            try:
                values[ready[0]] = ray.get(ready[0])
            except RayTaskError as e:
                if failure is None:
                    failure, deadline = _cause(e), time.monotonic() + PEER_TIMEOUT_S
            except DEAD as e:
                self._die(str(e))
        if failure is not None:
            raise failure
        return [values[ref] for ref in refs]

    def check_health(self) -> None:
        """Raises ``ExecutorDead`` (and stops the other actors) once an actor is gone."""
        self.check_dead()
        if not self._answer_pings():
            self._die("an actor does not answer (dead)")

    def alive(self) -> bool:
        """Every actor answers a ping; only looks (the ping runs on the actor's own health thread, so a
        running step does not delay it, and any thread may ask)."""
        return self.dead is None and self._answer_pings()

    def _answer_pings(self) -> bool:
        try:
            ray.get([actor.ping.remote() for actor in self.actors], timeout=HEALTH_TIMEOUT_S)
        except DEAD:
            return False
        except GetTimeoutError:  # alive but busy (say, the GIL held by a long step): not dead
            logger.warning("a worker actor did not answer a health check within %.0f s", HEALTH_TIMEOUT_S)
        return True

    def shutdown(self) -> None:
        self._finalizer()


@ray.remote(concurrency_groups={"health": 1})
class RankActor:
    """Holds one rank's ``Worker``; ``call`` runs one of its methods (in order: one thread, the default group)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def rendezvous(self) -> str:
        """A torch.distributed address on this node (rank 0's: its TCP store listens here)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def build(self, spec: WorkerSpec, placement: Placement) -> None:
        if placement.init_method.startswith("tcp://127.0.0.1:"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks meet on the loopback interface
        local = Placement(placement.rank, placement.tp_size, placement.pp_size, placement.init_method, _local_rank())
        self.worker = Worker(spec, local)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    @ray.method(concurrency_group="health")
    def ping(self) -> bool:
        return True


def _local_rank() -> int:
    """This actor's device among those it sees: Ray shows it only its own GPU, so usually 0."""
    ids = [str(i) for i in ray.get_gpu_ids()]
    if not ids:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return int(ids[0]) if visible is None else visible.split(",").index(ids[0])


def _init_ray() -> None:
    """Join the cluster this process belongs to (``RAY_ADDRESS``), else start a local one on 127.0.0.1."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)


def _placement_group(world_size: int, cuda: bool) -> tuple[PlacementGroup, bool]:
    """The current placement group (a Serve replica's: one bundle per rank), else a new one; and whether it
    is ours to remove."""
    current = get_current_placement_group()
    if current is not None:
        if len(current.bundle_specs) < world_size:
            raise ValueError(f"{world_size} ranks need as many bundles; this actor's placement group has "
                             f"{len(current.bundle_specs)} (give the deployment one bundle per rank)")
        return current, False
    bundle = {"GPU": 1} if cuda else CPU_BUNDLE
    # One node when one node has the devices (tensor parallelism wants NVLink); else as few nodes as can.
    one_node = not cuda or world_size <= max(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"])
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="STRICT_PACK" if one_node else "PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(f"the cluster has no room for {world_size} bundles of {bundle} "
                           f"(waited {PLACEMENT_TIMEOUT_S:.0f} s)") from None
    return group, True


def _cause(error: RayTaskError) -> BaseException:
    """The worker's own exception (as its class, so callers catch it by type)."""
    return error.cause if isinstance(error.cause, BaseException) else error.as_instanceof_cause()


def _stop(actors: list, group: PlacementGroup | None) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone, or Ray itself is shutting down
            pass
    if group is not None:
        try:
            remove_placement_group(group)
        except Exception:
            pass
