"""Host <-> device transfers of a step without stream synchronisations (used by the worker, the attention
backends and the sampler, hence here: below all of them).

``to_device``: a step's host numpy arrays reach the device in ONE non-blocking copy. On CUDA they
are packed, byte-aligned, into one pinned host buffer and copied with ``non_blocking=True``; the
tensors returned are dtype views of that one device buffer. A copy of pageable memory
(``torch.from_numpy(a).to("cuda")``) would instead block the host until the stream drains.
The pinned buffer comes from PyTorch's caching host allocator, not from buffers kept here:
a step's inputs vary in size, and the allocator records an event on the copy's stream and
reuses a block only once that event has completed, so the host may go on to fill the next
step's buffer while this one is still in flight (explicit double buffers would need sizing
and that same event bookkeeping). On the CPU the arrays become zero-copy ``torch.from_numpy``
views: no behaviour or speed change there.

``to_host``: device tensors come back with non-blocking copies into pinned memory and one event
synchronize: the step's one sanctioned device read. On the CPU the tensors are returned as they are.
"""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every dtype view of the device buffer starts aligned


def to_device(device: torch.device, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Each array as a tensor on ``device`` with the same dtype, shape and values."""
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    if device.type == "cpu":
        return tuple(torch.from_numpy(a) for a in arrays)
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    staging = torch.empty(max(end, 1), dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for a, start in zip(arrays, offsets):
        host[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    return tuple(on_device[start:start + a.nbytes].view(_torch_dtype(a)).view(a.shape)
                 for a, start in zip(arrays, offsets))


def _torch_dtype(a: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, a.dtype)).dtype


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor on the CPU. From CUDA: non-blocking copies into pinned memory, then one wait for them."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    copies = tuple(t.to("cpu", non_blocking=True) for t in tensors)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return copies
