"""Prefix-aware request routing across model replicas, on Ray Serve's request-router API.

A replica's prefix cache only helps requests that reach *that* replica, so
requests sharing a prompt prefix should land together. The ingress puts each
request's prompt text in ``ForwardedRequest.routing_key``; the router
remembers, per replica, which prompt prefixes it was sent, and sends a request
to the replica holding the longest match.

``PrefixIndex`` works like the engine's own block hashing, on characters:
a key is cut into ``chunk_chars``-sized chunks, chunk ``i`` is identified by
``hash(hash of chunk i-1, text of chunk i)``, and each chunk hash maps to the
replicas that were sent it. A replica matches a key to depth ``d`` when it
holds the hash of the key's ``d``-th chunk (chains make the earlier ones
implied). Entries are LRU-bounded; a trailing partial chunk is ignored.

Ranking (``rank_replicas``), per request:

- adapter: a request for a LoRA adapter (``ForwardedRequest.lora_name``)
  goes to the replicas holding it (``lora.py``: what they report, and where
  the router sent it lately) that are at most ``max_imbalance`` busier than
  the least-loaded replica, ranked among themselves as below; with none,
  every replica is ranked as below (the chosen one loads it on first use).
  Prefixes are indexed per adapter: an adapter's cached blocks serve only
  its own requests;
- match: the replica with the longest match, if it covers at least
  ``min_match_ratio`` of the key and its load (Serve's ongoing-request count)
  exceeds the least-loaded replica's by at most ``max_imbalance``;
- otherwise (no useful match, or the owner is hot): the least-loaded replica,
  ties broken by fewer indexed chunks, so fresh prefixes spread across
  replicas, then by lower KV usage (``record_routing_stats``: up to a stats
  period old, so it only breaks ties the router's own state cannot).

The chosen replica comes first; the others follow as fallback ranks (Serve
skips a replica whose ongoing requests are at ``max_ongoing_requests``): the
adapter's other holders within the bound, then the rest. Requests with
neither a key nor an adapter (``/health``, ``/metrics``, ``/v1/models``)
are routed by power of two choices.

Pickled by value into every process that holds a handle to the model
deployment: this module imports only Ray Serve, the standard library and
torch-free modules of its own (``lora.py``, the runtime's config).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from paged_runtime.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from rayserve_adapter.lora import AdapterPlacement, chain_root, holders_of

KV_CACHE_USAGE_STAT = "kv_cache_usage"  # the model replica's record_routing_stats key
MAX_KEY_CHARS = 64 * 1024  # a prefix this long is plenty to tell prompts apart; bounds the hashing per request
# The replica's default body limit: a larger body gets its 413 unparsed here.
MAX_KEYED_BODY_BYTES = DEFAULT_MAX_REQUEST_BODY_BYTES


class PrefixIndex:
    """Which replicas were sent which prompt prefixes; bounded to ``max_chunks`` chunk hashes (LRU)."""

    def __init__(self, chunk_chars: int = 64, max_chunks: int = 100_000) -> None:
        if chunk_chars < 1 or max_chunks < 1:
            raise ValueError("chunk_chars and max_chunks must be positive")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._owners: OrderedDict[bytes, set[Hashable]] = OrderedDict()  # chunk hash -> replicas, LRU order
        self._num_chunks: dict[Hashable, int] = {}  # replica -> chunk hashes it appears under

    def chunk_hashes(self, key: str, adapter: str | None = None) -> list[bytes]:
        """The chain of ``key``'s whole chunks, rooted at its adapter's root (``lora.chain_root``)."""
        hashes, parent = [], chain_root(adapter, b"")
        for start in range(0, len(key) - self.chunk_chars + 1, self.chunk_chars):
            parent = hashlib.blake2b(parent + key[start:start + self.chunk_chars].encode(), digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def match(self, key: str, adapter: str | None = None) -> tuple[dict[Hashable, int], int]:
        """({replica: matched chunks}, chunks in the key); replicas without a match are absent."""
        hashes = self.chunk_hashes(key, adapter)
        depths: dict[Hashable, int] = {}
        for depth, chunk_hash in enumerate(hashes, start=1):
            owners = self._owners.get(chunk_hash)
            if not owners:
                break
            self._owners.move_to_end(chunk_hash)
            for replica in owners:
                depths[replica] = depth
        return depths, len(hashes)

    def insert(self, key: str, replica: Hashable, adapter: str | None = None) -> None:
        for chunk_hash in self.chunk_hashes(key, adapter):
            owners = self._owners.setdefault(chunk_hash, set())
            self._owners.move_to_end(chunk_hash)
            if replica not in owners:
                owners.add(replica)
                self._num_chunks[replica] = self._num_chunks.get(replica, 0) + 1
        while len(self._owners) > self.max_chunks:
            _, owners = self._owners.popitem(last=False)
            for owner in owners:
                self._num_chunks[owner] -= 1

    def remove_replicas(self, replicas: Iterable[Hashable]) -> None:
        gone = set(replicas)
        for chunk_hash in list(self._owners):
            owners = self._owners[chunk_hash]
            owners -= gone
            if not owners:
                del self._owners[chunk_hash]
        for replica in gone:
            self._num_chunks.pop(replica, None)

    def num_chunks(self, replica: Hashable) -> int:
        return self._num_chunks.get(replica, 0)


def rank_replicas(replica_ids: list[Hashable], loads: Mapping[Hashable, int], depths: Mapping[Hashable, int],
                  num_key_chunks: int, kv_usages: Mapping[Hashable, float], index: PrefixIndex, *,
                  min_match_ratio: float, max_imbalance: int,
                  holders: Collection[Hashable] = ()) -> list[list[Hashable]]:
    """[[chosen], [the adapter's other warm holders], [the others, least loaded first]], without empty ranks
    (see the module docstring). ``holders``: the replicas holding the request's adapter (none: no adapter).
    A holder is warm while its load exceeds the least-loaded replica's by at most ``max_imbalance``."""
    least_load = min(loads[r] for r in replica_ids)
    warm = [r for r in replica_ids if r in holders and loads[r] - least_load <= max_imbalance]
    candidates = warm or replica_ids
    owner = max(candidates, key=lambda r: (depths.get(r, 0), -loads[r]))
    useful = num_key_chunks > 0 and depths.get(owner, 0) >= min_match_ratio * num_key_chunks
    if useful and loads[owner] - least_load <= max_imbalance:
        chosen = owner
    else:
        chosen = min(candidates, key=lambda r: (loads[r], index.num_chunks(r), kv_usages.get(r, 0.0)))
    other_warm = sorted((r for r in warm if r != chosen), key=lambda r: loads[r])
    others = sorted((r for r in replica_ids if r != chosen and r not in warm), key=lambda r: loads[r])
    return [rank for rank in ([chosen], other_warm, others) if rank]


def routing_key(path: str, body: bytes) -> str | None:
    """The text prefix-aware routing matches on: a completion's prompt, or a chat's message contents.

    Chat messages are joined as ``role: content`` lines (the chat template, which adds the same
    system text to every prompt, is the replica's business). Token-id prompts become their ids
    as text. Only the first ``MAX_KEY_CHARS`` count. None for anything else: a body the replica
    will refuse with a 400 (not JSON, too deep, a lone surrogate, wrong types, too large) never
    raises here; it routes by load and the replica gives the client its error.
    """
    return prompt_key(json_object(body)) if keyed(path, body) else None


def keyed(path: str, body: bytes) -> bool:
    """Whether the request may have a routing key: a completion or a chat, of a size the replica takes."""
    return path.endswith(("/completions", "/chat/completions")) and len(body) <= MAX_KEYED_BODY_BYTES


def json_object(body: bytes) -> dict | None:
    """``body`` as a JSON object; None for anything else (never raises)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError), or nested too deep
        return None
    return data if isinstance(data, dict) else None


def prompt_key(data: dict | None) -> str | None:
    """``routing_key`` of a keyed request's body already read by ``json_object``."""
    key = _key_of(data) if data is not None else None
    if not key:
        return None
    key = key[:MAX_KEY_CHARS]
    try:
        key.encode("utf-8")  # the index hashes the key's bytes
    except UnicodeEncodeError:  # a lone surrogate: the replica answers 400
        return None
    return key


def _key_of(data: dict) -> str | None:
    messages = data.get("messages")
    if isinstance(messages, list):
        return "\n".join(f"{_plain(m.get('role'))}: {_text(m.get('content'))}"
                         for m in messages if isinstance(m, dict))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts goes to one replica: route on the first
    if isinstance(prompt, list):
        return " ".join(str(t) for t in itertools.islice(prompt, MAX_KEY_CHARS // 2) if isinstance(t, int))
    return prompt if isinstance(prompt, str) else None


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_plain(part.get("text")) for part in content if isinstance(part, dict))
    return ""


class PrefixAffinityRouter(RequestRouter):
    """Serve's request router for the model deployment: prefix affinity, least-loaded when the owner is hot.

    ``request_router_kwargs``: ``chunk_chars`` (64), ``max_chunks`` (100,000),
    ``min_match_ratio`` (0.1), ``max_imbalance`` (4 ongoing requests), ``adapter_ttl_s`` (10: how long a
    replica sent an adapter counts as holding it before its stats say so).
    """

    def initialize_state(self, chunk_chars: int = 64, max_chunks: int = 100_000, min_match_ratio: float = 0.1,
                         max_imbalance: int = 4, adapter_ttl_s: float = 10.0) -> None:
        self.index = PrefixIndex(chunk_chars, max_chunks)
        self.placement = AdapterPlacement(adapter_ttl_s)
        self.min_match_ratio = min_match_ratio
        self.max_imbalance = max_imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key, adapter = _request_key(pending_request), request_adapter(pending_request)
        if key is None and adapter is None:  # power of two choices: the less loaded of two at random
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id: r for r in candidate_replicas}
        depths, num_chunks = self.index.match(key, adapter) if key is not None else ({}, 0)
        ranks = rank_replicas(list(by_id), {rid: self._load(rid) for rid in by_id}, depths, num_chunks,
                              {rid: _kv_usage(r) for rid, r in by_id.items()}, self.index,
                              min_match_ratio=self.min_match_ratio, max_imbalance=self.max_imbalance,
                              holders=self.adapter_holders(adapter, candidate_replicas))
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def adapter_holders(self, adapter: str | None, replicas: list[RunningReplica]) -> set[ReplicaID]:
        """The ids of ``replicas`` holding ``adapter`` (reported, or sent it lately); none for no adapter."""
        if adapter is None:
            return set()
        return holders_of(adapter, {r.replica_id: r.routing_stats for r in replicas}, self.placement.recent(adapter))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        key = _request_key(pending_request)
        if key is not None:
            self.index.insert(key, replica_id, request_adapter(pending_request))
        self.note_adapter(pending_request, replica_id)

    def note_adapter(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        adapter = request_adapter(pending_request)
        if adapter is not None:
            self.placement.sent(adapter, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        if gone:
            self.index.remove_replicas(gone)
            self.placement.remove_replicas(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove_replicas([replica_id])
        self.placement.remove_replicas([replica_id])

    def _load(self, replica_id: ReplicaID) -> int:
        """Ongoing requests as this router last saw them (sends counted at once); unknown counts as idle."""
        return self.replica_queue_len_cache.get(replica_id) or 0


def _request_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "routing_key", None)
    return key if isinstance(key, str) and key else None


def request_adapter(pending_request: PendingRequest | None) -> str | None:
    """The LoRA adapter the request names (``ForwardedRequest.lora_name``), or None."""
    if pending_request is None or not pending_request.args:
        return None
    name = getattr(pending_request.args[0], "lora_name", None)
    return name if isinstance(name, str) and name else None


def _kv_usage(replica: RunningReplica) -> float:
    stats = replica.routing_stats or {}
    value = stats.get(KV_CACHE_USAGE_STAT, 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0
