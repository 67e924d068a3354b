"""Health that never lies (issue 34, item 6): a step that hangs, a step thread that dies and a worker rank that
hangs each turn /health to 503 for good, fail the requests in flight at once, and are logged once."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import httpx
import pytest

from paged_runtime.engine.watchdog import StepWatchdog

from .conftest import running_server

BODY = {"prompt": "The quick brown fox", "max_tokens": 50, "ignore_eos": True}
DEADLINE_S = 30.0


def hang_steps(engine) -> tuple[threading.Event, threading.Event]:
    """From now on the engine's step blocks until the returned ``release`` is set; ``entered`` is set once a step
    is blocked (the hung kernel, or collective, of a real failure)."""
    real_step, entered, release = engine.engine.step, threading.Event(), threading.Event()

    def step():
        entered.set()
        assert release.wait(DEADLINE_S)
        return real_step()

    engine.engine.step = step
    return entered, release


def health_until(url: str, status: int) -> httpx.Response:
    deadline = time.monotonic() + DEADLINE_S
    while (response := httpx.get(f"{url}/health", timeout=10)).status_code != status:
        assert time.monotonic() < deadline, f"/health still answers {response.status_code}"
        time.sleep(0.05)
    return response


def test_the_watchdog_calls_once_for_a_pass_past_its_time_and_never_while_idle():
    calls, called = [], threading.Event()
    watchdog = StepWatchdog(0.2, lambda reason: (calls.append(reason), called.set()))
    try:
        assert not called.wait(0.6)  # idle: nothing is watched
        with watchdog.watching():
            assert called.wait(DEADLINE_S)
        assert len(calls) == 1 and "more than 0.2 s" in calls[0]
    finally:
        watchdog.stop()
    with pytest.raises(ValueError, match="must be positive"):
        StepWatchdog(0, lambda reason: None)


def test_a_hung_step_turns_health_to_503_for_good_and_fails_requests_in_flight(tiny_llama_dir, caplog):
    with running_server(tiny_llama_dir, "stuck", max_model_len=256, kv_cache_memory=8 * 2**20,
                        step_timeout=0.5) as server:
        assert httpx.post(f"{server.url}/v1/completions", json={**BODY, "max_tokens": 2}, timeout=60).status_code \
            == 200
        entered, release = hang_steps(server.engine)
        assert httpx.get(f"{server.url}/health").status_code == 200  # a hang-prone engine that idles is healthy

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S) as client:
                return await asyncio.gather(client.post("/v1/completions", json=BODY),
                                            client.post("/v1/completions", json={**BODY, "stream": True}))

        with caplog.at_level(logging.CRITICAL, logger="paged_runtime"):
            whole, streamed = asyncio.run(run())
        assert entered.is_set()
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "engine_unavailable"
        assert "stalled" in whole.json()["error"]["message"]
        assert streamed.status_code == 200 and "stalled" in streamed.text and streamed.text.endswith("[DONE]\n\n")
        health = health_until(server.url, 503)
        assert "stalled" in health.json()["error"]["message"]
        release.set()  # the step comes back: the verdict stands (a liveness probe restarts the pod)
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30).status_code == 503
        assert httpx.get(f"{server.url}/health").status_code == 503
        stalls = [r for r in caplog.records if "stalled" in r.getMessage()]
        assert len(stalls) == 1 and stalls[0].levelno == logging.CRITICAL


def test_a_step_thread_that_dies_turns_health_to_503(tiny_llama_dir):
    """Not an Exception: the loop thread ends on a BaseException and the engine must still say so."""
    with running_server(tiny_llama_dir, "killed", max_model_len=256, kv_cache_memory=8 * 2**20,
                        step_timeout=30) as server:
        def dying_step():
            raise SystemExit("the step thread was told to exit")

        server.engine.engine.step = dying_step
        response = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30)
        assert response.status_code == 503 and "SystemExit" in response.json()["error"]["message"]
        assert not server.engine._thread.is_alive()
        assert health_until(server.url, 503).json()["error"]["code"] == "engine_unavailable"


@pytest.mark.parallel
@pytest.mark.slow
def test_a_worker_rank_that_hangs_is_caught_by_the_watchdog(tiny_llama_dir):
    """Rank 1 of two is stopped by the kernel (SIGSTOP): the collective it owes never completes, the step never
    ends, and nothing but the watchdog can tell (the process is alive)."""
    with running_server(tiny_llama_dir, "ranks", max_model_len=256, kv_cache_memory=8 * 2**20,
                        tensor_parallel_size=2, step_timeout=2.0) as server:
        assert httpx.post(f"{server.url}/v1/completions", json={**BODY, "max_tokens": 2}, timeout=60).status_code \
            == 200
        pid = server.engine.engine.core.executor.worker_pids[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            response = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=DEADLINE_S)
            assert response.status_code == 503 and "stalled" in response.json()["error"]["message"]
            assert server.engine.engine.workers_alive()  # alive, only stopped: no process check can see it
            assert "stalled" in health_until(server.url, 503).json()["error"]["message"]
        finally:
            os.kill(pid, signal.SIGKILL)  # the stuck step then fails and the loop shuts the other rank down
