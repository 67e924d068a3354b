"""Over HTTP: values that once killed the engine for everyone are served or refused with a 400 naming the
field, and the engine keeps serving; streamed usage adds up the engine's delta outputs."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import assert_idle

from .conftest import TINY_NAME, sse_events


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("extra", [{"top_k": 2**70}, {"seed": 2**64 - 1, "n": 3}],
                         ids=["top_k-beyond-int64", "seed-near-2**64-with-siblings"])
def test_extreme_values_are_served_and_the_engine_lives(tiny_server, extra):
    body = {"model": TINY_NAME, "prompt": "a b c", "max_tokens": 3, "temperature": 1.0, **extra}
    response = post(tiny_server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == extra.get("n", 1)
    assert post(tiny_server, "/v1/completions", {"model": TINY_NAME, "prompt": "x", "max_tokens": 2}).status_code == 200
    tiny_server.wait_idle()
    assert_idle(tiny_server.engine)


@pytest.mark.parametrize("route,extra,param", [
    ("/v1/completions", {"repetition_penalty": 1e-300}, "repetition_penalty"),
    ("/v1/completions", {"temperature": 1e39}, "temperature"),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("/v1/completions", {"stop": ["x" * 513]}, "stop"),
    ("/v1/chat/completions", {"min_tokens": 600}, "min_tokens"),  # max_tokens unset: room is what is left
], ids=["repetition_penalty-underflow", "temperature-float32-inf", "too-many-stops", "stop-too-long",
        "min_tokens-past-context"])
def test_values_a_step_cannot_run_are_a_400(tiny_server, route, extra, param):
    body = {"model": TINY_NAME, **extra}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "a b c"}
    response = post(tiny_server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


def test_streamed_usage_and_text_add_up_the_deltas(tiny_server):
    body = {"model": TINY_NAME, "prompt": "one two three", "max_tokens": 7, "n": 2, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    whole = post(tiny_server, "/v1/completions", body).json()
    streamed = post(tiny_server, "/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    assert events[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 14
    for choice in whole["choices"]:
        chunks = [c for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert [t for c in chunks for t in c["logprobs"]["tokens"]] == choice["logprobs"]["tokens"]
        assert chunks[-1]["finish_reason"] == choice["finish_reason"] == "length"
