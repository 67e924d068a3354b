"""benchmarks/profile_step.py's per-step figures of a CUDA profile, from a profile's events (no GPU needed)."""
from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from benchmarks.profile_step import device_per_step


class FakeProfile:
    def __init__(self, events, averages):
        self._events, self._averages = events, averages

    def events(self):
        return self._events

    def key_averages(self):
        return self._averages


def on(device, us: float):
    return SimpleNamespace(device_type=device, self_device_time_total=us)


def test_per_step_figures_count_the_device_operations_their_time_and_the_host_syncs():
    events = [on(DeviceType.CUDA, 300.0), on(DeviceType.CUDA, 900.0), on(DeviceType.CPU, 5000.0),
              on(DeviceType.CUDA, 300.0)]
    averages = [SimpleNamespace(key="cudaEventSynchronize", count=3), SimpleNamespace(key="cudaLaunchKernel", count=9),
                SimpleNamespace(key="cudaStreamSynchronize", count=0)]
    assert device_per_step(FakeProfile(events, averages), steps=3) == {"syncs": 1.0, "device_ops": 1.0,
                                                                       "device_ms": 0.5}
