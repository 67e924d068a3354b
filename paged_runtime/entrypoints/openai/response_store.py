"""Stored responses (``store: true``): what GET /v1/responses/{id} returns and ``previous_response_id`` continues.

In memory, one store per router, keyed by (owner, response id): an owner (the caller's API key, see
``access.Tenant.owner``) never finds another owner's responses, whatever ids it guesses. Bounded by
count and by bytes; the least recently used entry (stored, read or continued) goes first. An entry's
size is its JSON text: the response body, the conversation it ends and the request's input items, so a
long chain of responses costs what its text costs, each entry holding its whole conversation (an evicted ancestor never
breaks a chain). An entry larger than the whole byte budget is not kept.

Used on the event loop only (no lock).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict  # the Response object, as GET returns it
    messages: list[dict]  # the conversation through this response, as chat messages (its instructions excepted)
    size: int  # entry_size(body, messages, input_items)
    input_items: list[dict] = field(default_factory=list)  # the request's input, as GET .../input_items lists it


def entry_size(body: dict, messages: list[dict], input_items: list[dict] | None = None) -> int:
    """Bytes an entry counts for: the UTF-8 JSON text (compact) of ``[body, messages]``, plus that of its input
    items when it has any."""
    return _json_bytes([body, messages]) + (_json_bytes(input_items) if input_items else 0)


def _json_bytes(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


class ResponseStore:
    """An LRU map (owner, response id) -> StoredResponse, holding at most ``max_entries`` entries and
    ``max_bytes`` bytes (either 0: nothing is stored)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be non-negative")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str | None, response_id: str, body: dict, messages: list[dict],
            input_items: list[dict] | None = None) -> bool:
        """Stores (or replaces) an entry as the most recent, evicting the least recent ones beyond the bounds;
        False when it cannot be kept at all (larger than the byte budget, or storing is off)."""
        self.delete(owner, response_id)
        size = entry_size(body, messages, input_items)
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        self._entries[(owner, response_id)] = StoredResponse(body, messages, size, list(input_items or ()))
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.size
        return True

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """The entry (now the most recent), or None."""
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, owner: str | None, response_id: str) -> bool:
        entry = self._entries.pop((owner, response_id), None)
        if entry is None:
            return False
        self.num_bytes -= entry.size
        return True
