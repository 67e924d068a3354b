"""utils.device_inputs on the CPU: zero-copy views with the arrays' values, dtypes and shapes (the CUDA
path, one pinned non-blocking copy, is checked in tests/kernels/test_one_sync_per_step.py)."""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.utils.device_inputs import to_device, to_host

CPU = torch.device("cpu")


def arrays():
    return (np.arange(5, dtype=np.int64), np.array([[1, 2, 3], [4, 5, 6]], np.int32),
            np.array([0.5, -1.25, np.inf], np.float32), np.array([True, False, True]), np.zeros(0, np.int64))


def test_cpu_tensors_are_views_with_the_arrays_values_dtypes_and_shapes():
    host = arrays()
    tensors = to_device(CPU, *host)
    assert [t.dtype for t in tensors] == [torch.int64, torch.int32, torch.float32, torch.bool, torch.int64]
    for a, t in zip(host, tensors):
        assert t.device == CPU and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
        assert np.shares_memory(t.numpy(), a) or a.size == 0  # zero-copy: nothing changes on the CPU path


def test_a_non_contiguous_array_arrives_contiguous_with_its_values():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    t, = to_device(CPU, a)
    assert t.is_contiguous() and t.tolist() == a.tolist()


def test_to_host_on_the_cpu_returns_the_tensors_themselves():
    x, y = torch.arange(3), torch.ones(2, 2)
    back = to_host(x, y)
    assert back[0] is x and back[1] is y
