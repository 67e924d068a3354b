"""Process-level tuning for CPU inference."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+; Python names it only on newer builds


def keep_freed_memory_mapped() -> None:
    """Stop glibc from handing large freed buffers back to the OS.

    A decode step allocates the same multi-megabyte temporaries (gathered KV,
    MLP activations) every layer; with glibc's defaults each one is a fresh
    mmap whose pages fault in one by one, which measured 3x slower than the
    copy itself. Serving them from a heap that is never trimmed removes that
    cost; the KV cache (far larger) is still mapped directly.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_THRESHOLD, 256 * 2**20)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        logger.debug("mallopt unavailable; allocator left as is")


_ALIGN = 64  # bytes: every tensor starts on a cache line


def huge_page_buffer(nbytes: int, resident: bool = False) -> torch.Tensor | None:
    """A zeroed uint8 CPU tensor backed by transparent huge pages, or None where the platform lacks them.

    A decode step streams every weight and most of the KV cache once; on 4 KiB pages that is a TLB miss
    every 64 cache lines, and the decode kernels measured ~13% faster over 2 MiB pages.
    ``resident``: every page faulted in now, not at its first write (see ``_fault_in``).
    Raises MemoryError when the memory is not there to be had.
    """
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes <= 0:
        return None
    try:
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise _out_of_memory(e, nbytes)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, same memory
        logger.debug("MADV_HUGEPAGE refused; using ordinary pages")
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the mapping alive
    if resident:
        _fault_in(buffer, tensor)
    return tensor


def _fault_in(buffer: mmap.mmap, tensor: torch.Tensor) -> None:
    """Fault in every page of ``buffer`` now: the kernel zeroes each once, nothing writes it twice.

    Left to their first write, a KV cache's pages fault in inside the steps that first use them (a stall,
    and in these VMs a first touch costs 1.8 s a GiB: the host backs the page too), and the memory the
    server counted on is not yet held. vLLM zeroes its cache at start-up; so do we, without the writes.
    """
    try:
        buffer.madvise(_MADV_POPULATE_WRITE)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise _out_of_memory(e, len(buffer))
        tensor[::mmap.PAGESIZE].zero_()  # a kernel before 5.14: one write a page does the same


def _out_of_memory(error: OSError, nbytes: int) -> Exception:
    if error.errno in (errno.ENOMEM, errno.EFAULT):
        return MemoryError(f"{nbytes} bytes of memory are not to be had on this machine")
    return error


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)``, resident, on huge pages where available."""
    storage = huge_page_buffer(math.prod(shape) * dtype.itemsize, resident=True)
    return torch.zeros(shape, dtype=dtype) if storage is None else storage.view(dtype).view(shape)


def move_to_huge_pages(module: torch.nn.Module) -> None:
    """Re-home a CPU module's parameters into one huge-page buffer (see ``huge_page_buffer``).

    Call before loading weights: the old storage is dropped, not copied.
    """
    params = [p for p in module.parameters() if p.device.type == "cpu"]
    offsets, size = [], 0
    for p in params:
        offsets.append(size)
        size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    storage = huge_page_buffer(size)
    if storage is None:
        return
    for p, offset in zip(params, offsets):
        nbytes = p.numel() * p.element_size()
        p.data = storage[offset:offset + nbytes].view(p.dtype).view(p.shape)
