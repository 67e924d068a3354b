"""A worker process killed mid-request (tensor parallelism, two ranks): the stream in flight ends with an
error (none hangs), /health turns 503, new requests get 503, and shutdown leaves no worker process behind."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from tests.conftest import process_alive

from .conftest import running_server, sse_events

pytestmark = [pytest.mark.server, pytest.mark.parallel]


def test_a_killed_worker_fails_requests_and_the_health_check(tiny_llama_dir):
    with running_server(tiny_llama_dir, "split", max_model_len=512, kv_cache_memory=8 * 2**20,
                        tensor_parallel_size=2) as server:
        pids = server.engine.engine.core.executor.worker_pids
        assert httpx.get(f"{server.url}/health").status_code == 200
        body = {"prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True, "stream": True}

        async def kill_mid_stream() -> str:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    chunks = []
                    async for chunk in response.aiter_text():
                        if not chunks:
                            os.kill(pids[1], signal.SIGKILL)  # the request is in flight: tokens came back
                        chunks.append(chunk)
                    return "".join(chunks)

        events = sse_events(asyncio.run(asyncio.wait_for(kill_mid_stream(), 60)))
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "worker 1 exited (killed by signal 9)" in error["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        late = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert late.status_code == 503
    assert not any(process_alive(pid) for pid in pids)
