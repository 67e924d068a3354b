"""LoRA adapters across Ray Serve replicas: named at the ingress, tracked on each replica, routed to their holders.

A request's ``model`` names an adapter by its name or as ``base:adapter``, and a replica loads a folder of
``dynamic_lora_loading_path`` on its first request for it (``LoRAAdapters`` in
``paged_runtime/entrypoints/openai/lora_adapters.py``). The ingress cannot know which adapters exist, so it only
tells the served base names from the rest (``AdapterNames``): a request naming anything else goes to its base
model's deployment, whose replica decides (a 404 for no such adapter), and carries the adapter's name to the
router (``ForwardedRequest.lora_name``).

Multiplexed routing, as ``serve.multiplexed`` does it for Serve's own model ids: each replica reports the
adapters its engine has read (``LoRAAdapters.read_by``) in its routing stats (``lora_adapters``), and the routers send
a request for an adapter to a replica holding it unless that one is more than ``max_imbalance`` requests
busier than the least loaded (``router.rank_replicas``). Stats arrive up to a stats period late, so the router
also counts a replica it sent the adapter to in the last ``ttl_s`` seconds as a holder (``AdapterPlacement``):
a burst of first requests loads it once, not once per replica.

Torch-free, standard library only: the ingress and the routers (pickled by value) import it.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LORA_ADAPTERS_STAT = "lora_adapters"  # the model replica's record_routing_stats key: the adapters it holds
SEPARATOR = ":"  # "base:adapter", as LoRAAdapters reads it
MAX_NAME_CHARS = 4096  # longer is no adapter name (a folder name is at most 255 bytes); bounds the router's memory
ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a PEFT adapter


@dataclass(frozen=True)
class AdapterNames:
    """What the ingress knows of model names when the deployments serve LoRA: every served name of the base
    model(s), the first the base of an adapter named alone (as in ``LoRAAdapters``), and the adapters' folder."""
    base_names: tuple[str, ...]
    dynamic_path: str | None = None

    def base_of(self, model: str) -> str | None:
        """The served base ``model`` runs over: itself, or ``base`` of ``base:adapter``; None for an adapter
        named alone, or a name no deployment serves (the first model's replica then decides)."""
        if model in self.base_names:
            return model
        base, sep, name = model.partition(SEPARATOR)
        return base if sep and name and base in self.base_names else None

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter ``model`` asks for: None for a base model or none; ``adapter`` of ``base:adapter``;
        else ``model`` itself (an adapter, or a name no replica knows: none reports holding it, so it routes
        as a base request would). None too for a name that cannot be one (not UTF-8: a lone surrogate, which
        the replica refuses; longer than ``MAX_NAME_CHARS``): it must never fail the ingress or the router."""
        if not model or model in self.base_names or len(model) > MAX_NAME_CHARS:
            return None
        try:
            model.encode("utf-8")
        except UnicodeEncodeError:
            return None
        base, sep, name = model.partition(SEPARATOR)
        return name if sep and name and base in self.base_names else model

    def folder_entries(self, created: int) -> list[dict]:
        """/v1/models entries for the adapter folders of ``dynamic_path`` (those with an adapter_config.json),
        over the first base model: any replica loads one on first use, so the ingress lists them whichever
        replica answers the listing (as Ray Serve LLM lists its LoRA folders). Nothing where this node cannot
        read the folder. Blocking: run it off the event loop."""
        if self.dynamic_path is None:
            return []
        root = os.path.expanduser(self.dynamic_path)
        try:
            with os.scandir(root) as entries:
                names = sorted(e.name for e in entries if self._loadable(e.name)
                               and os.path.isfile(os.path.join(e.path, ADAPTER_CONFIG)))
        except OSError:
            return []
        return [{"id": name, "object": "model", "created": created, "owned_by": "paged-runtime",
                 "root": os.path.join(root, name), "parent": self.base_names[0], "max_model_len": None}
                for name in names]

    def _loadable(self, name: str) -> bool:
        """Whether a request naming folder ``name`` loads it (``LoRAAdapters._dynamic_folder``) and the name
        can be listed (UTF-8: a folder name that is not comes back with lone surrogates)."""
        return self.adapter_of(name) == name and "\\" not in name


def unique_by_id(entries: Iterable[dict]) -> list[dict]:
    """/v1/models entries, the first of each id (several deployments and the folder may list one adapter)."""
    seen: set[Any] = set()
    unique = []
    for entry in entries:
        if entry.get("id") not in seen:
            seen.add(entry.get("id"))
            unique.append(entry)
    return unique


class AdapterPlacement:
    """Where a router sent requests for each adapter in the last ``ttl_s`` seconds, for at most ``max_names``
    adapters (the least recently sent out first: names are the clients' to choose)."""

    def __init__(self, ttl_s: float = 10.0, max_names: int = 10_000) -> None:
        if ttl_s < 0 or max_names < 1:
            raise ValueError("ttl_s must be at least 0 and max_names positive")
        self.ttl_s, self.max_names = ttl_s, max_names
        self._sent: OrderedDict[str, dict[Hashable, float]] = OrderedDict()  # name -> replica -> until

    def sent(self, name: str, replica: Hashable, now: float | None = None) -> None:
        until = (time.monotonic() if now is None else now) + self.ttl_s
        self._sent.setdefault(name, {})[replica] = until
        self._sent.move_to_end(name)
        while len(self._sent) > self.max_names:
            self._sent.popitem(last=False)

    def recent(self, name: str, now: float | None = None) -> set[Hashable]:
        """The replicas sent ``name`` in the last ``ttl_s`` seconds."""
        now = time.monotonic() if now is None else now
        replicas = self._sent.get(name)
        if not replicas:
            return set()
        for replica in [r for r, until in replicas.items() if until < now]:
            del replicas[replica]
        if not replicas:
            del self._sent[name]
        return set(replicas)

    def remove_replicas(self, replicas: Iterable[Hashable]) -> None:
        gone = set(replicas)
        for name in list(self._sent):
            for replica in gone & self._sent[name].keys():
                del self._sent[name][replica]
            if not self._sent[name]:
                del self._sent[name]


def holders_of(name: str | None, reported: Mapping[Hashable, Any], recent: Iterable[Hashable] = ()) -> set[Hashable]:
    """The replicas of ``reported`` (replica -> its routing stats) that hold adapter ``name``: those whose
    ``lora_adapters`` list it, and those of ``recent`` (sent it lately: their stats may not show it yet)."""
    if name is None:
        return set()
    recent = set(recent)
    return {replica for replica, stats in reported.items() if replica in recent or name in reported_adapters(stats)}


def reported_adapters(stats: Mapping[str, Any] | None) -> list | tuple:
    """The adapters a replica's routing stats list (none where the stats are missing or malformed)."""
    held = (stats or {}).get(LORA_ADAPTERS_STAT)
    return held if isinstance(held, (list, tuple)) else ()


def chain_root(adapter: str | None, base: bytes) -> bytes:
    """The root of an adapter's prefix chains: an adapter's cached blocks serve only its own requests (the
    engine keys them by adapter), so a base prompt must not match them, nor an adapter prompt base blocks."""
    if adapter is None:
        return base
    return hashlib.blake2b(base + b"\0lora\0" + adapter.encode("utf-8", "surrogatepass"), digest_size=16).digest()
