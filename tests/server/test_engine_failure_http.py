"""A step that raises: every client gets an error (none hangs), /health turns 503, new requests get 503."""
from __future__ import annotations

import asyncio
import json

import httpx

from .conftest import fail_on_step, running_server, sse_events


def test_failing_step_over_http(tiny_llama_dir):
    with running_server(tiny_llama_dir, "doomed", max_model_len=256, kv_cache_memory=8 * 2**20) as server:
        fail_on_step(server.engine, 5, "simulated device failure")
        body = {"prompt": "The quick brown fox", "max_tokens": 100, "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                return await asyncio.gather(client.post("/v1/completions", json=body),
                                            client.post("/v1/completions", json={**body, "stream": True}))

        whole, streamed = asyncio.run(asyncio.wait_for(run(), 60))
        assert whole.status_code == 503
        assert whole.json()["error"]["code"] == "engine_unavailable"
        assert "simulated device failure" in whole.json()["error"]["message"]
        assert streamed.status_code == 200  # the stream had started: the error travels in-band
        events = sse_events(streamed.text)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "simulated device failure" in error["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        late = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert late.status_code == 503
