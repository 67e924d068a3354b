"""Kernel tests run on the GPU when there is one, else in Triton's CPU interpreter.

Triton decides between compiling and interpreting when a kernel is defined, i.e.
when its module is imported, reading ``TRITON_INTERPRET`` then; the interpreter
reads it again while it runs. So without a GPU this conftest imports the kernel
modules with the variable set, before any test can import them, and sets it again
around each test here: tests elsewhere in the session never see it. (The runtime
imports the kernels only on first use, so no earlier test has defined them compiled.)
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from paged_runtime.kernels import triton_available

KERNEL_MODULES = ("paged_runtime.kernels.store_kv", "paged_runtime.kernels.attention", "paged_runtime.kernels.fused",
                  "paged_runtime.kernels.lora", "paged_runtime.kernels.quant_gemm")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"


def _define_kernels_interpreted() -> None:
    defined = [name for name in KERNEL_MODULES if name in sys.modules]
    if defined:
        raise RuntimeError(f"{defined} were imported before the kernel tests could set TRITON_INTERPRET=1; "
                           "without a GPU they cannot run compiled")
    # Triton's own library (tl.sum, tl.max, ...) is defined when triton.language is first imported: a module that
    # imports it earlier in the session without the variable (peft does) leaves every kernel failing with
    # "Cannot call @triton.jit'd outside of the scope of a kernel".
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(standard.sum).__name__ != "InterpretedFunction":
        raise RuntimeError("triton.language was imported before the kernel tests could set TRITON_INTERPRET=1 (by a "
                           "test module's import at collection, e.g. peft's): import such packages inside tests")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


if not triton_available():
    collect_ignore_glob = ["test_*.py"]  # triton is a Linux x86_64 dependency: nothing to test elsewhere
elif INTERPRETED:
    _define_kernels_interpreted()


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
