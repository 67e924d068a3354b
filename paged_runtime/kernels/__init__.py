"""Triton kernels for the paged KV cache (the ``triton`` attention backend).

- ``store_kv``: write a step's new K and V into their cache slots.
- ``paged_attention``: one varlen kernel for mixed prefill/decode batches, with
  a split-KV variant for long decodes.

Importing this package does not import Triton; its submodules do, and define
their kernels when imported. Triton decides whether a kernel runs on the GPU or
in its CPU interpreter (``TRITON_INTERPRET=1``) at that moment, so the backend
imports them on first use, and the kernel tests import them with the variable
set.
"""
from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Triton is a Linux x86_64 dependency only; elsewhere only the torch backend runs."""
    return importlib.util.find_spec("triton") is not None
