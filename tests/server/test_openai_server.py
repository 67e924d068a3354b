"""The OpenAI-compatible server over HTTP (real uvicorn on 127.0.0.1), driven by the official ``openai`` SDK.

Greedy texts are compared with the offline ``LLM`` API on the same weights;
bodies are checked against OpenAI's own spec (openai-subset.json).
"""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest

from tests.conftest import assert_idle
from paged_runtime import SamplingParams
from paged_runtime.kernels import cpu

from .conftest import TINY_NAME, running_server, sse_events

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(tiny_server):
    return openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def offline(llm, prompts, **params) -> list:
    return [o.outputs for o in llm.generate(prompts, SamplingParams(**params), use_tqdm=False)]


def post(server, path: str, body, timeout: float | httpx.Timeout = 60) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


# ---- basic routes ------------------------------------------------------------------------------
def test_models_health_version(tiny_server, client, openai_schema):
    models = client.models.list()
    assert [m.id for m in models.data] == [TINY_NAME]
    body = httpx.get(f"{tiny_server.url}/v1/models").json()
    openai_schema("ListModelsResponse", body)
    assert body["data"][0]["max_model_len"] == 512
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    # the kernels the engine's worker runs (here in this process): the build for this CPU and each family's path
    kernels = {"isa": cpu.isa(), "variants": cpu.kernel_variants()} if cpu.has_vector_paths() else None
    assert httpx.get(f"{tiny_server.url}/version").json() == {"version": "0.1.0", "cpu_kernels": kernels}
    assert kernels is None or list(kernels["variants"]) == ["linear", "attention", "norms", "lora", "gguf", "gguf_x8"]


def test_version_shows_no_cpu_kernels_where_the_engine_runs_none(tiny_llama_dir):
    with running_server(tiny_llama_dir, TINY_NAME, max_model_len=64, kv_cache_memory=2**20,
                        cpu_kernels=False) as server:
        assert httpx.get(f"{server.url}/version").json() == {"version": "0.1.0", "cpu_kernels": None}


def test_tokenize_detokenize_round_trip(tiny_server, tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    body = post(tiny_server, "/tokenize", {"prompt": PROMPTS[1]}).json()
    assert body["tokens"] == tokenizer.encode(PROMPTS[1]) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    assert post(tiny_server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": PROMPTS[1]}
    chat = post(tiny_server, "/tokenize", {"messages": MESSAGES}).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)


# ---- completions -------------------------------------------------------------------------------
def test_completions_greedy_match_offline(client, tiny_llm, openai_schema):
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS, max_tokens=16, temperature=0)
    expected = offline(tiny_llm, PROMPTS, max_tokens=16, temperature=0)
    openai_schema("CreateCompletionResponse", response.model_dump(exclude_unset=True))
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e[0].text for e in expected]
    assert [c.finish_reason for c in response.choices] == [e[0].finish_reason for e in expected]
    tokenizer = tiny_llm.get_tokenizer()
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert response.usage.completion_tokens == sum(len(e[0].token_ids) for e in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_completions_token_id_prompts(client, tiny_llm):
    ids = [[5, 6, 7, 8], [100, 200, 300]]
    response = client.completions.create(model=TINY_NAME, prompt=ids, max_tokens=8, temperature=0)
    expected = offline(tiny_llm, [{"prompt_token_ids": p} for p in ids], max_tokens=8, temperature=0)
    assert [c.text for c in response.choices] == [e[0].text for e in expected]
    assert response.usage.prompt_tokens == 7


def test_completions_stream_sync(client, tiny_llm, openai_schema):
    chunks = list(client.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    expected = offline(tiny_llm, PROMPTS[:1], max_tokens=20, temperature=0)[0][0]
    for chunk in chunks:
        openai_schema("CompletionStreamChunk", chunk.model_dump(exclude_unset=True))
    content, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in content) == expected.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + [expected.finish_reason]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_async_two_prompts_n2(aclient):
    async def run():
        stream = await aclient.completions.create(model=TINY_NAME, prompt=PROMPTS, max_tokens=10, n=2,
                                                  temperature=1.0, seed=7, stream=True,
                                                  extra_body={"ignore_eos": True})
        texts, finishes = {}, {}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    assert choice.index not in finishes  # exactly one finishing chunk per choice
                    finishes[choice.index] = choice.finish_reason
        whole = await aclient.completions.create(model=TINY_NAME, prompt=PROMPTS, max_tokens=10, n=2,
                                                 temperature=1.0, seed=7, extra_body={"ignore_eos": True})
        return texts, finishes, whole

    texts, finishes, whole = asyncio.run(run())
    assert sorted(texts) == [0, 1, 2, 3] and finishes == {i: "length" for i in range(4)}
    # Seeded sampling does not depend on the batch: streaming and not give the same choices.
    assert [texts[c.index] for c in whole.choices] == [c.text for c in whole.choices]
    assert whole.usage.completion_tokens == 40


def test_completions_n2_seed_matches_offline(client, tiny_llm):
    params = dict(max_tokens=12, temperature=0.8, seed=1234, n=2)
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS[1], **params)
    expected = offline(tiny_llm, PROMPTS[1:], **params)[0]
    assert [c.text for c in response.choices] == [e.text for e in expected]
    other = client.completions.create(model=TINY_NAME, prompt=PROMPTS[1], **{**params, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in response.choices]


def test_completions_best_of(client, tiny_llm):
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.0,
                                         n=1, best_of=3, seed=5)
    expected = offline(tiny_llm, PROMPTS[:1], max_tokens=8, temperature=1.0, n=1, best_of=3, seed=5)[0]
    assert [c.text for c in response.choices] == [e.text for e in expected]


def test_completions_logprobs(client, tiny_llm, openai_schema):
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                         logprobs=3)
    openai_schema("CreateCompletionResponse", response.model_dump(exclude_unset=True))
    lp = response.choices[0].logprobs
    expected = offline(tiny_llm, PROMPTS[:1], max_tokens=6, temperature=0, logprobs=3)[0][0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(expected.token_ids) == 6
    for position, (token_id, entry) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert lp.token_logprobs[position] == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert lp.tokens[position] == entry[token_id].decoded_token
        assert 3 <= len(lp.top_logprobs[position]) <= 4
        assert max(lp.top_logprobs[position].values()) == pytest.approx(lp.token_logprobs[position])  # greedy
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]


def test_completions_echo(client, tiny_llm):
    plain = client.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    echoed = client.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True,
                                       logprobs=1)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    num_prompt = len(tiny_llm.get_tokenizer().encode(PROMPTS[0]))
    assert len(lp.tokens) == num_prompt + 5
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])


def test_completions_stop_string(client, tiny_llm):
    free = offline(tiny_llm, PROMPTS[:1], max_tokens=30, temperature=0)[0][0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    response = client.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                         stop=[stop])
    expected = offline(tiny_llm, PROMPTS[:1], max_tokens=30, temperature=0, stop=[stop])[0][0]
    choice = response.choices[0]
    assert choice.text == expected.text == free[:free.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


# ---- chat --------------------------------------------------------------------------------------
def test_chat_greedy_matches_offline(client, tiny_llm, openai_schema):
    response = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    openai_schema("CreateChatCompletionResponse", response.model_dump(exclude_unset=True))
    expected = tiny_llm.chat(MESSAGES, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_chat_content_parts_and_max_completion_tokens(client):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    a = client.chat.completions.create(model=TINY_NAME, messages=parts, max_completion_tokens=7, temperature=0)
    b = client.chat.completions.create(model=TINY_NAME, messages=flat, max_tokens=7, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 7


def test_chat_stream_framing(tiny_server, tiny_llm, openai_schema):
    """Raw SSE: role chunk first, content, finish_reason on the last content chunk, usage, [DONE]."""
    body = {"model": TINY_NAME, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    response = post(tiny_server, "/v1/chat/completions", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        openai_schema("CreateChatCompletionStreamResponse", chunk)
        assert chunk["object"] == "chat.completion.chunk"
    first, content, usage = chunks[0], chunks[1:-1], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    expected = tiny_llm.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == expected.text
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12


def test_chat_stream_async_n2_logprobs(aclient):
    async def run():
        stream = await aclient.chat.completions.create(
            model=TINY_NAME, messages=MESSAGES, max_tokens=8, n=2, temperature=0.9, seed=3, stream=True,
            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        roles, tokens, finishes = set(), {0: 0, 1: 0}, {}
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.add(choice.index)
                if choice.logprobs and choice.logprobs.content:
                    tokens[choice.index] += len(choice.logprobs.content)
                    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        return roles, tokens, finishes

    roles, tokens, finishes = asyncio.run(run())
    assert roles == {0, 1} and tokens == {0: 8, 1: 8} and finishes == {0: "length", 1: "length"}


def test_chat_logprobs(client, openai_schema):
    response = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    openai_schema("CreateChatCompletionResponse", response.model_dump(exclude_unset=True))
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs),
                                                                 reverse=True)
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy picks the most likely
        assert token.bytes == list(token.token.encode())


def test_chat_stop_and_seed(client, tiny_llm):
    params = dict(max_tokens=10, temperature=1.0, seed=42)
    a = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, **params)
    b = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, **params)
    expected = tiny_llm.chat(MESSAGES, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert a.choices[0].message.content == b.choices[0].message.content == expected.text
    stop = expected.text[2:5]
    stopped = client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, stop=stop, **params)
    assert stopped.choices[0].message.content == expected.text[:expected.text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


# ---- errors ------------------------------------------------------------------------------------
LONG_PROMPT = [7] * 500
ERROR_CASES = [
    # (route, body, status, param, code)
    ("/v1/completions", "{not json", 400, None, "invalid_json"),
    ("/v1/completions", "[1, 2]", 400, None, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "abc"}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-5"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 20}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [7] * 512, "max_tokens": 1}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 65}, 400, "n", None),  # > max_num_seqs
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "x", "best_of": 65}, 400, "best_of", None),  # > max_num_seqs
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "priority": 5}, 400, "priority", None),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature", "invalid_value"),  # OpenAI's cap
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"model": TINY_NAME}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice, as in vLLM
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice", None),
    # an invalid constraint: the compiler's message, naming the field it came from, before any compute
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format",
     None),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", None),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}, 400, "guided_regex", None),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= foo"}, 400, "guided_grammar", None),
    ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, 400, "guided_json", None),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400, "guided_choice", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a"}, "guided_regex": "b"}, 400,
     "guided_regex", None),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, 400,
     "structured_outputs.structural_tag", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {}}, 400, "structured_outputs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_decoding_backend": "outlines"}, 400,
     "guided_decoding_backend", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "messages[0].content[0]",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id", None),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, 400, "messages[0].tool_calls[0]", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", None),
    # SamplingParams' logprobs and max_tokens, named as the chat request spells them
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 600}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True}, 400,
     "continue_final_message", None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("/tokenize", {}, 400, "prompt", None),
]


@pytest.mark.parametrize("route,body,status,param,code", ERROR_CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}-{c[3]}" for i, c in enumerate(ERROR_CASES)])
def test_error_cases(tiny_server, openai_schema, route, body, status, param, code):
    response = post(tiny_server, route, body)
    assert response.status_code == status, response.text
    error = response.json()
    openai_schema("ErrorResponse", error)
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["param"] == param and error["error"]["code"] == code
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]


def test_context_error_names_both_numbers(tiny_server):
    error = post(tiny_server, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 20}).json()["error"]
    assert "512" in error["message"] and "520" in error["message"]  # the limit and prompt + max_tokens
    assert "500 in the prompt, 20 in the completion" in error["message"]


def test_errors_through_sdk_then_server_still_serves(client, tiny_server):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, n=0)
    assert info.value.body["param"] == "n"
    assert httpx.get(f"{tiny_server.url}/v1/nothing-here").status_code == 404
    response = client.completions.create(model=TINY_NAME, prompt="still alive", max_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


# ---- disconnects, metrics ----------------------------------------------------------------------
@pytest.mark.slow
def test_fifty_streams_half_disconnect(tiny_server):
    """25 clients read to the end, 25 leave after two chunks; afterwards nothing runs and no block is held."""
    before = tiny_server.metrics()
    body = {"model": TINY_NAME, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    async def one(client: httpx.AsyncClient, i: int, leave: bool) -> tuple[int, str | None, int | None]:
        num_chunks, finish, num_tokens = 0, None, None
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": f"{PROMPTS[0]} {i}"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    num_chunks += 1
                    finish = chunk["choices"][0]["finish_reason"] or finish
                else:
                    num_tokens = chunk["usage"]["completion_tokens"]
                if leave and num_chunks == 2:
                    break  # closes the connection mid-stream
        return (num_chunks if leave else None), finish, num_tokens

    async def run():
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=tiny_server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i, leave=i % 2 == 1) for i in range(50)))

    results = asyncio.run(run())
    assert [r for i, r in enumerate(results) if i % 2 == 0] == [(None, "length", 200)] * 25
    assert [r for i, r in enumerate(results) if i % 2 == 1] == [(2, None, None)] * 25
    after = tiny_server.wait_idle()
    labels = lambda reason: ("vllm:request_success_total",
                             tuple(sorted({"model_name": TINY_NAME, "finished_reason": reason}.items())))
    assert after[labels("abort")] - before[labels("abort")] == 25
    assert after[labels("length")] - before[labels("length")] == 25
    assert_idle(tiny_server.engine)


def test_non_streaming_disconnect_aborts(tiny_server, caplog):
    before = tiny_server.metric("vllm:request_success_total", finished_reason="abort")
    body = {"model": TINY_NAME, "prompt": PROMPTS[0], "max_tokens": 450, "ignore_eos": True, "n": 4}
    with caplog.at_level(logging.WARNING):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 4 x 450 tokens are done
            post(tiny_server, "/v1/completions", body, timeout=httpx.Timeout(60, read=0.5))
        tiny_server.wait_idle()
    assert tiny_server.metric("vllm:request_success_total", finished_reason="abort") == before + 1
    assert_idle(tiny_server.engine)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []  # a quiet abort


def test_metrics_parse_and_move(tiny_server):
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
             "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
             "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
             "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count"]
    tiny_server.wait_idle()
    before = {n: tiny_server.metric(n) for n in names}
    for n in names:
        assert (n, (("model_name", TINY_NAME),)) in tiny_server.metrics(), n
    body = {"model": TINY_NAME, "prompt": [11] * 40, "max_tokens": 9, "ignore_eos": True}
    assert post(tiny_server, "/v1/completions", body).status_code == 200
    assert post(tiny_server, "/v1/completions", body).status_code == 200  # the same 40-token prefix again
    tiny_server.wait_idle()
    moved = {n: tiny_server.metric(n) - before[n] for n in names}
    assert moved["vllm:prompt_tokens_total"] == 80 and moved["vllm:generation_tokens_total"] == 18
    assert moved["vllm:time_to_first_token_seconds_count"] == 2
    assert moved["vllm:inter_token_latency_seconds_count"] == 16
    assert moved["vllm:e2e_request_latency_seconds_count"] == 2
    assert moved["vllm:request_queue_time_seconds_count"] == 2
    for phase in ("prefill", "decode", "inference"):
        assert moved[f"vllm:request_{phase}_time_seconds_count"] == 2, phase
    assert moved["vllm:prefix_cache_queries_total"] == 80
    assert moved["vllm:prefix_cache_hits_total"] == 32  # the second request finds two full 16-token blocks
    assert tiny_server.metric("vllm:request_success_total", finished_reason="length") >= 2


def test_cache_config_info_names_the_kv_cache(tiny_server):
    """vLLM's info gauge, read by llm-d's scheduler for the block size and the number of blocks."""
    [labels] = [dict(labels) for (name, labels), value in tiny_server.metrics().items()
                if name == "vllm:cache_config_info" and value == 1.0]
    core = tiny_server.engine.engine.core
    assert labels == {"model_name": TINY_NAME, "block_size": "16", "cache_dtype": "auto",
                      "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
                      "num_gpu_blocks": str(core.num_blocks), "num_cpu_blocks": "None",
                      "prefix_caching_hash_algo": "sha256"}


def test_metrics_show_running_requests(tiny_server):
    """While a long stream runs, the running gauge and KV usage are above zero."""
    body = {"model": TINY_NAME, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        running = tiny_server.metric("vllm:num_requests_running")
        usage = tiny_server.metric("vllm:kv_cache_usage_perc")
    assert running == 1 and usage > 0
    tiny_server.wait_idle()
