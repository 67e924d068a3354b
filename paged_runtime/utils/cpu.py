"""Process-level tuning for CPU inference."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


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
