"""The CPU KV cache's memory is held from the start: every page faulted in when the engine is built, none left to
fault in (zeroed by the kernel, in a VM backed by the host too) inside the steps that first write it; and a cache
this machine cannot hold is refused at start-up, naming the setting."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from tests.conftest import make_llm
from paged_runtime.utils import cpu
from paged_runtime.utils.cpu import huge_page_buffer
from paged_runtime.worker.model_runner import allocate_kv_caches

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="the huge-page buffers are Linux's")
PAGE = mmap.PAGESIZE


def resident_share(tensor) -> float:
    """The share of ``tensor``'s pages this process holds in memory (/proc/self/pagemap's present bit: one
    8-byte entry a page, by the page's address)."""
    first = tensor.data_ptr() // PAGE
    last = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return float(((entries >> np.uint64(63)) & np.uint64(1)).mean())


def test_every_page_of_the_kv_cache_is_resident_once_the_engine_is_built(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, kv_cache_memory=64 * 2**20, max_model_len=128)
    caches = llm.engine.core.runner.kv_caches
    assert len(caches) == 2  # the tiny model's two layers
    for cache in caches:
        assert resident_share(cache) == 1.0


def test_a_buffer_not_asked_to_be_resident_faults_in_on_first_write():
    """The control: the same mapping without ``resident`` holds nothing until written (so the test above can
    tell the two apart)."""
    buffer = huge_page_buffer(8 * 2**20)
    assert resident_share(buffer) == 0.0
    buffer[::PAGE] = 1
    assert resident_share(buffer) == 1.0


def test_a_kv_cache_larger_than_memory_is_refused_naming_the_setting(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, kv_cache_memory=16 * 2**20, max_model_len=128)
    model = llm.engine.core.runner.model
    with pytest.raises(MemoryError, match="give it less \\(kv_cache_memory\\)"):
        allocate_kv_caches(model, 2**40, llm.engine.core.runner.kv_caches[0].dtype, llm.engine.core.runner.device)


def test_a_kernel_without_populate_gets_its_pages_by_one_write_each(monkeypatch):
    """Linux before 5.14 answers MADV_POPULATE_WRITE with EINVAL, as it does this unknown advice."""
    monkeypatch.setattr(cpu, "_MADV_POPULATE_WRITE", 999)
    buffer = huge_page_buffer(8 * 2**20, resident=True)
    assert resident_share(buffer) == 1.0
    assert int(buffer.count_nonzero()) == 0
