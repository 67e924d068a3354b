"""KV-event routing: send each request to the replica whose KV cache holds the longest prefix of its tokens.

Each model replica publishes its KV-cache events (``paged_runtime/core/kv_events.py``: vLLM's format) on a PUB
socket of its own, under the topic ``kv@<replica id>``, and reports the socket's address in its routing stats
(``kv_events_endpoint``). ``KVEventRouter`` subscribes to every replica it is given and keeps
``KVBlockIndex``: which replica holds which block, by a chain key computed from the blocks' token ids, so
the index never needs to know how a replica hashes (its algorithm, seed or salts). The ingress asks a
replica to render each request first (``/render``: the exact prompt token ids, chat template applied) and
puts the ids on the request (``ForwardedRequest.routing_tokens``).

Ranking is the prefix-affinity router's (``router.rank_replicas``): the replica with the most leading blocks
of the prompt cached, unless it is more than ``max_imbalance`` requests busier than the least loaded one;
ties and misses go by load. What the index knows is what the replicas hold, evictions included, so a
replica that dropped a conversation's blocks stops attracting it. Between routing a request and its
blocks' events (a step later, or more while it waits), the index expects them where the request went: an
expected block counts like a stored one for ``expect_ttl_s`` seconds (default 30), or until an event about
it arrives; so a burst of one prefix stays together before its first blocks are even computed.

LoRA: a request for an adapter (``ForwardedRequest.lora_name``) goes to a replica holding the adapter, as with
prefix affinity (``router.rank_replicas``, ``lora.py``). The engine keys an adapter's blocks by its name, and its
events carry it (``lora_name``): the index roots an adapter's chains apart from the base model's
(``lora.chain_root``), so a prompt matches only the blocks its own adapter (or the base) computed.

The index may lag or miss events (a dropped batch, a replica restarted): then a choice is worse, never wrong:
any replica can serve any request. Tenants' salted blocks are indexed by their tokens alone, so a salted
request may be sent where only another tenant's blocks are; it then computes its prompt, as anywhere.

Pickled by value into the processes that hold a handle, like ``router.py``: Ray Serve, the standard library,
msgpack, pyzmq and the runtime's torch-free modules only.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from array import array
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RunningReplica

from paged_runtime.core.kv_events import decode_batch, decode_event
from rayserve_adapter.lora import chain_root
from rayserve_adapter.router import PrefixAffinityRouter, rank_replicas, request_adapter

KV_EVENTS_ENDPOINT_STAT = "kv_events_endpoint"  # the model replica's record_routing_stats keys
KV_BLOCK_SIZE_STAT = "kv_block_size"
TOPIC_PREFIX = "kv@"
ROOT = b"paged-runtime kv router"

logger = logging.getLogger("rayserve_adapter")


def topic_of(replica_id: str) -> str:
    return f"{TOPIC_PREFIX}{replica_id}"


def chain_keys(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The key of each full block of ``token_ids``, chained from ``parent``: the same tokens after the same
    prefix give the same key on every replica."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + array("q", token_ids[start:start + block_size]).tobytes(),
                                 digest_size=16).digest()
        keys.append(parent)
    return keys


class KVBlockIndex:
    """Which replica holds which block, from their KV events; thread-safe (events come on a thread)."""

    def __init__(self, expect_ttl_s: float = 30.0) -> None:
        self._lock = threading.Lock()
        self._keys: dict[Hashable, dict[Any, bytes]] = {}  # replica -> its block hash -> chain key
        self._holders: dict[bytes, set[Hashable]] = {}  # chain key -> replicas holding that block
        self._expected: dict[bytes, dict[Hashable, float]] = {}  # chain key -> replica -> until (monotonic)
        self._num_expected: dict[Hashable, int] = {}  # replica -> its entries in _expected
        self.expect_ttl_s = expect_ttl_s
        self.block_size: int | None = None  # the replicas' (one application: one block size)

    def expect(self, replica: Hashable, token_ids: Sequence[int], adapter: str | None = None) -> None:
        """``replica`` was just sent a prompt of ``token_ids`` (for ``adapter``): count its blocks there until
        events tell."""
        if self.block_size is None:
            return
        until = time.monotonic() + self.expect_ttl_s
        with self._lock:
            for key in chain_keys(token_ids, self.block_size, chain_root(adapter, ROOT)):
                expected = self._expected.setdefault(key, {})
                if replica not in expected:
                    self._num_expected[replica] = self._num_expected.get(replica, 0) + 1
                expected[replica] = until

    def _unexpect(self, key: bytes, replica: Hashable) -> None:
        expected = self._expected.get(key)
        if expected is not None and expected.pop(replica, None) is not None:
            self._num_expected[replica] -= 1
            if not expected:
                del self._expected[key]

    def apply(self, replica: Hashable, tag: str, event: dict[str, Any]) -> None:
        """One decoded event (``kv_events.decode_event``) from ``replica``."""
        with self._lock:
            if tag == "BlockStored":
                self._stored(replica, event)
            elif tag == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    self._drop(replica, block_hash)
            elif tag == "AllBlocksCleared":
                self._forget(replica)

    def _stored(self, replica: Hashable, event: dict[str, Any]) -> None:
        keys = self._keys.setdefault(replica, {})
        parent_hash = event["parent_block_hash"]
        lora_name = event.get("lora_name")  # a chain's first block roots it at its adapter's root
        if parent_hash is None:
            parent = chain_root(lora_name if isinstance(lora_name, str) and lora_name else None, ROOT)
        else:
            parent = keys.get(parent_hash)
        if parent is None:
            return  # its parent's event never came (dropped): the chain cannot be placed
        self.block_size = event["block_size"]
        for block_hash, key in zip(event["block_hashes"], chain_keys(event["token_ids"], self.block_size, parent)):
            keys[block_hash] = key
            self._holders.setdefault(key, set()).add(replica)
            self._unexpect(key, replica)

    def _drop(self, replica: Hashable, block_hash: Any) -> None:
        key = self._keys.get(replica, {}).pop(block_hash, None)
        if key is not None:
            self._unexpect(key, replica)
        holders = self._holders.get(key) if key is not None else None
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[key]

    def _forget(self, replica: Hashable) -> None:
        for block_hash in list(self._keys.get(replica, {})):
            self._drop(replica, block_hash)
        self._keys.pop(replica, None)
        for key in [k for k, expected in self._expected.items() if replica in expected]:
            self._unexpect(key, replica)
        self._num_expected.pop(replica, None)

    def remove_replicas(self, replicas: Iterable[Hashable]) -> None:
        with self._lock:
            for replica in replicas:
                self._forget(replica)

    def match(self, token_ids: Sequence[int], adapter: str | None = None) -> tuple[dict[Hashable, int], int]:
        """({replica: leading full blocks of ``token_ids`` (for ``adapter``) it holds}, full blocks in
        ``token_ids``)."""
        with self._lock:
            if self.block_size is None:
                return {}, 0
            keys = chain_keys(token_ids, self.block_size, chain_root(adapter, ROOT))
            depths: dict[Hashable, int] = {}
            alive: set[Hashable] | None = None
            now = time.monotonic()
            for depth, key in enumerate(keys, start=1):
                holders = self._holders.get(key, set()) | self._expecting(key, now)
                alive = holders if alive is None else alive & holders
                if not alive:
                    break
                for replica in alive:
                    depths[replica] = depth
            return depths, len(keys)

    def _expecting(self, key: bytes, now: float) -> set[Hashable]:
        expected = self._expected.get(key)
        if not expected:
            return set()
        for replica in [r for r, until in expected.items() if until < now]:
            self._unexpect(key, replica)
        return set(self._expected.get(key, ()))

    def num_chunks(self, replica: Hashable) -> int:
        """Blocks indexed or expected for ``replica`` (``rank_replicas`` spreads fresh prompts toward the
        emptier)."""
        return len(self._keys.get(replica, {})) + self._num_expected.get(replica, 0)


class KVEventSubscriber:
    """One SUB socket on a thread of its own, connected to each replica's endpoint, feeding ``index``.

    ``follow`` may be called from any thread; the socket is only touched by its thread (ZMQ sockets are not
    thread-safe), which applies new endpoints between polls.
    """

    POLL_MS = 100

    def __init__(self, index: KVBlockIndex) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._endpoints: dict[str, str] = {}  # replica id -> endpoint it publishes on
        self._to_connect: list[str] = []
        self._last_seq: dict[str, int] = {}
        self.num_gaps = 0  # batches seen missing (dropped by a replica, or before we connected)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    def follow(self, replica_id: str, endpoint: str | None) -> None:
        if not endpoint:
            return
        with self._lock:
            if self._endpoints.get(replica_id) != endpoint:
                self._endpoints[replica_id] = endpoint
                self._to_connect.append(endpoint)

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        import zmq
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX.encode())
        try:
            while not self._stopped.is_set():
                with self._lock:
                    endpoints, self._to_connect = self._to_connect, []
                for endpoint in endpoints:
                    sub.connect(endpoint)
                while sub.poll(self.POLL_MS):
                    self._receive(*sub.recv_multipart())
        except Exception:
            logger.exception("the KV-event subscriber stopped; routing falls back to load")
        finally:
            sub.close(linger=0)

    def _receive(self, topic: bytes, seq: bytes, payload: bytes) -> None:
        replica = topic.decode()[len(TOPIC_PREFIX):]
        number = int.from_bytes(seq, "big")
        last = self._last_seq.get(replica)
        if last is not None and number != last + 1:
            self.num_gaps += 1
        self._last_seq[replica] = number
        for event in decode_batch(payload)[1]:
            try:
                self.index.apply(replica, *decode_event(event))
            except (ValueError, KeyError, TypeError):
                logger.debug("skipped a KV event the index cannot read: %r", event)


class KVEventRouter(PrefixAffinityRouter):
    """Serve's request router for KV-event routing (module docstring); requests without token ids (health,
    metrics, a body the replica will refuse) go as the prefix-affinity router sends them.

    ``request_router_kwargs``: the prefix-affinity router's (``min_match_ratio``, ``max_imbalance``, ...).
    """

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.kv_index = KVBlockIndex()
        self.subscriber = KVEventSubscriber(self.kv_index)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            self.subscriber.follow(replica.replica_id.unique_id, stats.get(KV_EVENTS_ENDPOINT_STAT))
            if self.kv_index.block_size is None and isinstance(stats.get(KV_BLOCK_SIZE_STAT), int):
                self.kv_index.block_size = stats[KV_BLOCK_SIZE_STAT]
        tokens = request_tokens(pending_request)
        if not candidate_replicas or tokens is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        adapter = request_adapter(pending_request)
        depths, num_blocks = self.kv_index.match(tokens, adapter)
        holders = {rid.unique_id for rid in self.adapter_holders(adapter, candidate_replicas)}
        ranks = rank_replicas(list(by_id), {rid: self._load(r.replica_id) for rid, r in by_id.items()}, depths,
                              num_blocks, {}, self.kv_index, min_match_ratio=self.min_match_ratio,
                              max_imbalance=self.max_imbalance, holders=holders)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        tokens = request_tokens(pending_request)
        if tokens is None:
            super().on_request_routed(pending_request, replica_id, result)
        else:
            self.kv_index.expect(replica_id.unique_id, tokens, request_adapter(pending_request))
            self.note_adapter(pending_request, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {r.unique_id for r in self.curr_replicas} - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        if gone:
            self.kv_index.remove_replicas(gone)


def request_tokens(pending_request: PendingRequest | None) -> Sequence[int] | None:
    if pending_request is None or not pending_request.args:
        return None
    tokens = getattr(pending_request.args[0], "routing_tokens", None)
    return tokens if tokens else None
