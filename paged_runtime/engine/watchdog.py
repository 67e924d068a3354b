"""A watchdog on the step loop: a pass that runs past its time declares the engine stalled.

The loop thread brackets each pass that has work (adding, aborting, stepping, delivering) with
``watching()``. A thread of the watchdog's own looks ``timeout / 4`` (at most 1 s) apart; once a pass
has run for more than ``timeout`` seconds it calls ``on_stall`` with the reason, once, and stops
watching. What a stall means is the caller's: ``AsyncEngine`` latches itself dead, so ``/health``
says 503 from then on (a liveness probe restarts the pod) and every request in flight gets an error
at once instead of waiting on a step that may never end: a hung kernel, a deadlocked collective, a
worker rank stopped by the kernel. An idle engine is never stalled: nothing is watched between
passes.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class StepWatchdog:
    """Calls ``on_stall(reason)`` (on the watchdog's thread) when one pass runs past ``timeout`` seconds."""

    def __init__(self, timeout: float, on_stall: Callable[[str], None]) -> None:
        if not timeout > 0:
            raise ValueError(f"the step timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.on_stall = on_stall
        self._pass_started: float | None = None  # written by the loop thread, read here (one attribute: atomic)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="paged-runtime-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Brackets one pass of the loop."""
        self._pass_started = time.monotonic()
        try:
            yield
        finally:
            self._pass_started = None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout / 4)
        while not self._stopped.wait(interval):
            started = self._pass_started
            if started is not None and time.monotonic() - started > self.timeout:
                self._stopped.set()
                self.on_stall(f"the engine stalled: a step has run for more than {self.timeout:g} s "
                              "(--engine-step-timeout); it is declared dead and every request in it failed")
