"""The worker's adapters: a fixed-size slot table on the device, a bounded cache in host memory, and each
step's row -> slot map.

``max_loras`` slots hold the adapters a step may run (the scheduler never puts more distinct adapters in one
step); ``max_cpu_loras`` read adapters stay in host memory (least recently used out), so an adapter that lost
its slot comes back by a copy, not a read of its folder. A step whose adapter is in neither is read then: the
request waits for the load, it never fails for it. Slots are reused least recently used first, never one the
step needs.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from paged_runtime.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from paged_runtime.layers.lora import enable_lora, lora_layers
from paged_runtime.lora.peft import LoRAAdapter, read_adapter
from paged_runtime.lora.request import LoRAConfig, LoRAError, LoRARequest

logger = logging.getLogger(__name__)


class LoRASlots:
    def __init__(self, model, config: LoRAConfig, ops, dtype: torch.dtype, device: torch.device) -> None:
        if not hasattr(model, "checkpoint_module"):
            raise LoRAError(f"{type(model).__name__} does not serve LoRA adapters")
        self.model, self.config, self.device = model, config, device
        self.step = enable_lora(model, config.max_loras, config.max_lora_rank, ops, dtype, device)
        self.layers = lora_layers(model)
        self.requests: dict[int, LoRARequest] = {}  # every adapter this worker was told of, by id
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapters in slots, least recently used first
        self.written: dict[int, list[str]] = {}  # slot -> the layers its last adapter wrote (all else is zeros)

    # ---- adapters --------------------------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> None:
        """Read and check ``request``'s adapter into host memory (``LoRAError`` says why it cannot run)."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise LoRAError(f"adapter id {request.lora_int_id} is already {known.lora_name!r}")
        if request.lora_int_id not in self.host:
            self._cache(read_adapter(request, self.model, self.config.max_lora_rank))
        self.requests[request.lora_int_id] = request

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (its slot is free for the next); a later request for it needs ``add`` again."""
        self.requests.pop(lora_id, None)
        self.host.pop(lora_id, None)
        self.slot_of.pop(lora_id, None)

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.request.lora_int_id] = adapter
        self.host.move_to_end(adapter.request.lora_int_id)
        while len(self.host) > self.config.cpu_capacity:
            self.host.popitem(last=False)

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self.host.get(lora_id)
        if adapter is None:  # evicted from host memory: read again
            adapter = read_adapter(self.requests[lora_id], self.model, self.config.max_lora_rank)
            self._cache(adapter)
        self.host.move_to_end(lora_id)
        return adapter

    # ---- a step --------------------------------------------------------------------------------------------
    def prepare(self, row_lora_ids: np.ndarray) -> None:
        """Set the step's row -> slot map from each row's adapter id (0: none), loading the step's adapters into
        slots first."""
        ids = set(np.unique(row_lora_ids).tolist()) - {0}
        if not ids:
            self.step.row_slots = None
            return
        slot_of = self.activate(ids)
        lookup = np.full(int(row_lora_ids.max()) + 1, -1, np.int64)
        for lora_id, slot in slot_of.items():
            lookup[lora_id] = slot
        self.step.row_slots = torch.from_numpy(lookup[row_lora_ids]).to(self.device)

    def activate(self, ids: set[int]) -> dict[int, int]:
        """Each of ``ids`` in a slot (at most ``max_loras`` of them): id -> slot."""
        if len(ids) > self.config.max_loras:
            raise RuntimeError(f"{len(ids)} adapters in one step, over max_loras {self.config.max_loras}")
        unknown = ids - set(self.requests)
        if unknown:
            raise LoRAError(f"adapters {sorted(unknown)} were never added to this worker")
        for lora_id in sorted(ids - set(self.slot_of)):
            self._load(lora_id, self._free_slot(ids))
        for lora_id in sorted(ids):
            self.slot_of.move_to_end(lora_id)
        return {lora_id: self.slot_of[lora_id] for lora_id in ids}

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(lora_id for lora_id in self.slot_of if lora_id not in needed)
        return self.slot_of.pop(victim)

    def _load(self, lora_id: int, slot: int) -> None:
        """Invariant: a slot holds zeros wherever its adapter has no weights (untargeted layers and parts, ranks
        below max_lora_rank), so they add exact zeros. Only the layers the previous adapter wrote are cleared, in
        one multi-tensor call (a zero_ per tensor costs ~1 ms each where OpenMP threads are busy elsewhere)."""
        adapter = self._adapter(lora_id)
        stale = [self.layers[path].lora for path in self.written.pop(slot, ())]
        if stale:
            torch._foreach_zero_([t[slot] for w in stale for t in (w.a, w.b)])
        for path, parts in adapter.parts.items():
            for part, (a, b) in parts.items():
                place_part(self.layers[path], slot, part, a, b)
        self.written[slot] = list(adapter.parts)
        self.slot_of[lora_id] = slot
        logger.debug("adapter %s in slot %d", adapter.request.lora_name, slot)


def place_part(layer: LinearBase, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """Copy one part's full-size (A, B) into ``layer``'s slot as this rank holds it: a column-parallel layer all
    of A (at the part's rank rows) and its output rows of B (through the layer's own loader, which places and
    shards a fused part as it does the weight); a row-parallel one its input columns of A and all of B."""
    w, rank = layer.lora, a.shape[0]
    a_rows = w.a[slot, part * w.rank:part * w.rank + rank]
    if isinstance(layer, RowParallelLinear):
        layer.weight_loader(a_rows, a)
        w.b[slot, :, :rank].copy_(b)
        return
    a_rows.copy_(a)
    padded = torch.zeros(b.shape[0], w.rank, dtype=w.b.dtype)
    padded[:, :rank] = b
    shard = "qkv"[part] if isinstance(layer, QKVParallelLinear) else (
        part if isinstance(layer, MergedColumnParallelLinear) else None)
    layer.weight_loader(w.b[slot], padded, shard)
