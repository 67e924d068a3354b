"""What Ray Serve's request routers read from a replica, without Ray running one."""
from __future__ import annotations

from ray.serve._private.common import DeploymentID, ReplicaID


class FakeReplica:
    """A RunningReplica as a router sees it: id, capacity, routing stats, placement."""

    def __init__(self, name: str, max_ongoing_requests: int = 8, routing_stats: dict | None = None) -> None:
        self.replica_id = ReplicaID(name, DeploymentID("PagedRuntimeServer", "app"))
        self.max_ongoing_requests = max_ongoing_requests
        self.routing_stats: dict = dict(routing_stats or {})
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "node", None, set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0
