"""API-key auth on /v1 routes, and the bounded waiting queue (503 + Retry-After) over HTTP."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from .conftest import running_server

KEY = "s3cret-key"
NAME = "guarded"


@pytest.fixture(scope="module")
def guarded_server(tiny_llama_dir):
    """One sequence at a time, one waiting request at most; the step can be held by the test."""
    with running_server(tiny_llama_dir, NAME, api_key=KEY, max_waiting_requests=1, max_num_seqs=1,
                        max_model_len=256, kv_cache_memory=8 * 2**20) as server:
        yield server


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers,message", [
    ({}, "Missing API key"),
    (auth("wrong"), "Incorrect API key"),
    ({"Authorization": KEY}, "Missing API key"),  # no Bearer scheme
    (auth(KEY + "x"), "Incorrect API key"),
])
def test_v1_routes_need_the_key(guarded_server, headers, message):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
        response = httpx.request(method, f"{guarded_server.url}{path}", headers=headers,
                                 json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
        assert response.status_code == 401, (path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert message in error["message"] and error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error" and error["param"] is None


def test_key_opens_v1_and_other_routes_stay_open(guarded_server):
    client = openai.OpenAI(base_url=f"{guarded_server.url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=NAME, prompt="hello", max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded_server.url}/v1", api_key="nope", max_retries=0).models.list()
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{guarded_server.url}{path}").status_code == 200


def test_full_queue_answers_503_with_retry_after(guarded_server):
    """A runs, B waits (the limit), C is refused; A and B then finish untouched."""
    engine = guarded_server.engine
    real_step, hold, release, in_step = engine.engine.step, threading.Event(), threading.Event(), threading.Event()

    def held_step():
        if hold.is_set():
            in_step.set()
            assert release.wait(30)
        return real_step()

    engine.engine.step = held_step
    body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 40, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=guarded_server.url, headers=auth(KEY), timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                      "stream_options": {"include_usage": True}}) as a:
                lines = a.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # A is running
                hold.set()
                assert await asyncio.to_thread(in_step.wait, 30)  # the loop is inside a step
                b = asyncio.create_task(client.post("/v1/completions", json=body))
                deadline = time.monotonic() + 30
                while engine.num_unfinished_requests < 2:  # B has reached the engine's queue
                    assert time.monotonic() < deadline and not b.done()
                    await asyncio.sleep(0.01)
                c = await client.post("/v1/completions", json=body)
                release.set()
                a_text = "".join([line async for line in lines])
            return a_text, await b, c

    try:
        a_text, b, c = asyncio.run(run())
    finally:
        release.set()
        engine.engine.step = real_step
    assert c.status_code == 503 and c.headers["retry-after"] == "1"
    error = c.json()["error"]
    assert "max_waiting_requests" in error["message"] and error["code"] == "server_overloaded"
    assert '"completion_tokens":40' in a_text and a_text.endswith("data: [DONE]")
    assert b.status_code == 200 and b.json()["usage"]["completion_tokens"] == 40
    guarded_server.wait_idle()
    client = openai.OpenAI(base_url=f"{guarded_server.url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=NAME, prompt="again", max_tokens=2).usage.completion_tokens == 2
