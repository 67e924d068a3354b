"""POST /v1/responses (issue 37, item 1) over HTTP (real uvicorn on 127.0.0.1), driven by the openai SDK's
``responses.create``, ``responses.stream`` and ``responses.parse``.

The route runs on the chat route's machinery, so greedy outputs are compared with chat completions of the same
conversation: the same prompt tokens (usage) and the same text. Bodies and stream events are validated against
the SDK's own types. Two API keys are two owners of stored responses.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from paged_runtime.entrypoints.openai.access import ApiKeys
from paged_runtime.entrypoints.openai.response_store import ResponseStore, entry_size

from .conftest import running_server

NAME = "tiny-responses"
KEY_A, KEY_B = "key-a", "key-b"
BLOCK_SIZE = 16
MAX_BODY = 2**20
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": WEATHER_PARAMETERS, "strict": True}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


class Answer(pydantic.BaseModel):
    word: str = pydantic.Field(max_length=8)
    count: int = pydantic.Field(ge=0, le=9)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir, NAME, api_key=[KEY_A, KEY_B], max_model_len=512, block_size=BLOCK_SIZE,
                        kv_cache_memory=16 * 2**20, app_options={"max_request_body_bytes": MAX_BODY}) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def other_client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_B, max_retries=0, timeout=120)


def post(server, path: str, body, key: str = KEY_A) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=120,
                      headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})


def check_body(body: dict) -> None:
    """The body against the SDK's Response type (strict pydantic validation), its usage apart: it has
    input_tokens_details only with --enable-prompt-tokens-details (as chat's prompt_tokens_details)."""
    Response.model_validate({**body, "usage": None})
    assert body["object"] == "response" and body["id"].startswith("resp_")
    for item in body["output"]:
        assert item["id"].startswith({"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}[item["type"]])
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert set(usage["output_tokens_details"]) == {"reasoning_tokens"}


def check_event(event: dict) -> None:
    """A stream event against the SDK's event types (its response checked as ``check_body`` does)."""
    if "response" in event:
        if event["response"]["usage"] is not None:
            check_body(event["response"])
        event = {**event, "response": {**event["response"], "usage": None}}
    EVENTS.validate_python(event)


def chat_text(client, messages, **kwargs):
    """The chat route's answer to the same conversation: (text, usage, finish_reason)."""
    completion = client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kwargs)
    choice = completion.choices[0]
    return choice.message.content, completion.usage, choice.finish_reason


def expected_status(finish_reason: str) -> str:
    return {"length": "incomplete", "stop": "completed"}[finish_reason]


# ---- one response: the same tokens as chat -----------------------------------------------------------------
def test_string_input_with_instructions_is_chat_with_a_system_message(server, client):
    response = client.responses.create(model=NAME, input="Write one sentence about the sea.",
                                       instructions="Answer briefly.", max_output_tokens=16, temperature=0)
    text, usage, finish = chat_text(client, [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": "Write one sentence about the sea."}],
                                    max_completion_tokens=16)
    assert response.output_text == text and text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens,
                                                                          usage.completion_tokens)
    assert response.status == expected_status(finish)
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == response.status
    assert [part.type for part in message.content] == ["output_text"]
    assert (response.instructions, response.max_output_tokens, response.temperature, response.model) == (
        "Answer briefly.", 16, 0.0, NAME)
    body = client.responses.retrieve(response.id).model_dump(exclude_unset=True)
    check_body(body)
    assert body == response.model_dump(exclude_unset=True)  # stored as returned
    assert "input_tokens_details" not in body["usage"]  # cached_tokens only with --enable-prompt-tokens-details


def test_message_and_function_items_are_the_chat_conversation(client):
    items = [{"role": "user", "content": "What is the weather in Rome?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Rome", "unit": "celsius"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is clear."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"},
                                          {"type": "input_text", "text": "Briefly."}]}]
    response = client.responses.create(model=NAME, input=items, max_output_tokens=12, temperature=0)
    messages = [{"role": "user", "content": "What is the weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
                {"role": "assistant", "content": "It is clear."},
                {"role": "user", "content": "And tomorrow?\nBriefly."}]
    text, usage, _ = chat_text(client, messages, max_completion_tokens=12)
    assert (response.output_text, response.usage.input_tokens) == (text, usage.prompt_tokens)


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(model=NAME, input="Name a color.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=NAME, input="Why that one?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    history = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": first.output_text}]
    # The first response's instructions are not carried over (OpenAI's rule).
    text, usage, _ = chat_text(client, history + [{"role": "user", "content": "Why that one?"}],
                               max_completion_tokens=8)
    assert (second.output_text, second.usage.input_tokens) == (text, usage.prompt_tokens)
    assert second.previous_response_id == first.id
    third = client.responses.create(model=NAME, input="Thanks.", previous_response_id=second.id,
                                    instructions="Be kind.", max_output_tokens=8, temperature=0)
    text, usage, _ = chat_text(client, [{"role": "system", "content": "Be kind."}, *history,
                                        {"role": "user", "content": "Why that one?"},
                                        {"role": "assistant", "content": second.output_text},
                                        {"role": "user", "content": "Thanks."}], max_completion_tokens=8)
    assert (third.output_text, third.usage.input_tokens) == (text, usage.prompt_tokens)


def test_store_false_keeps_nothing(server, client):
    response = client.responses.create(model=NAME, input="Hello.", store=False, max_output_tokens=4)
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(response.id)
    assert e.value.body["code"] == "not_found" and response.id in e.value.body["message"]
    reply = post(server, "/v1/responses", {"input": "Go on.", "previous_response_id": response.id})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "previous_response_id"


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = client.responses.create(model=NAME, input="Count to fifty.", max_output_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[0].status == "incomplete"
    assert response.completed_at is None


# ---- streaming -------------------------------------------------------------------------------------------------
def test_stream_events_come_in_openai_order_and_build_the_response(server, client):
    request = dict(model=NAME, input="Tell me a story.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{'incomplete' if whole.status == 'incomplete' else 'completed'}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for event in events:
        check_event(event.model_dump(exclude_unset=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_item.done")
    final = events[-1].response
    assert text == whole.output_text == final.output_text
    assert final.output == [done.item] and final.status == whole.status and final.usage == whole.usage
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert client.responses.retrieve(final.id).output_text == text  # stored once finished
    raw = httpx.post(f"{server.url}/v1/responses", json={**request, "stream": True}, timeout=60,
                     headers={"Authorization": f"Bearer {KEY_A}"}).text
    first = raw.split("\n\n")[0].split("\n")
    assert first[0] == "event: response.created" and json.loads(first[1][len("data: "):])["type"] == first[0][7:]


@pytest.mark.slow
def test_parse_and_stream_give_schema_valid_json_as_chat_does(client):
    request = dict(model=NAME, input="Give a word and a count.", max_output_tokens=64, temperature=0)
    parsed = client.responses.parse(**request, text_format=Answer)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
    with client.responses.stream(**request, text_format=Answer) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[-1] == "response.completed" and "response.output_text.delta" in events
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text
    chat = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": request["input"]}],
                                         response_format=Answer, max_completion_tokens=64, temperature=0)
    assert chat.choices[0].message.content == parsed.output_text
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Answer"


@pytest.mark.slow
def test_a_forced_function_call_then_its_output(client):
    request = dict(model=NAME, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    response = client.responses.create(**request)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.status == "completed" and response.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": request["input"]}], temperature=0, max_completion_tokens=60,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    events = list(client.responses.create(**request, stream=True))
    assert [e.type for e in events][2] == "response.output_item.added" and events[2].item.type == "function_call"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert arguments == done.arguments == call.arguments
    # The call's output continues the conversation as a tool message after the assistant's call.
    follow = client.responses.create(model=NAME, previous_response_id=response.id, max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    text, usage, _ = chat_text(client, [
        {"role": "user", "content": request["input"]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], max_completion_tokens=8)
    assert (follow.output_text, follow.usage.input_tokens) == (text, usage.prompt_tokens)


def test_required_tool_choice_calls_a_tool(client):
    response = client.responses.create(model=NAME, input="Weather?", tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    assert [item.type for item in response.output] == ["function_call"] and response.status == "completed"
    jsonschema.validate(json.loads(response.output[0].arguments), WEATHER_PARAMETERS)


# ---- the store: owners, delete, background, cancel --------------------------------------------------------------
def test_an_owner_never_reads_another_owners_responses(server, client, other_client):
    mine = client.responses.create(model=NAME, input="A secret.", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.create(model=NAME, input="Tell me.", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.cancel(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id
    # Owners are the keys, whether or not the keys share a prefix cache.
    shared = ApiKeys([KEY_A, KEY_B], share_prefix_cache=True)
    tenant_a, tenant_b = (shared.authenticate(f"Bearer {key}") for key in (KEY_A, KEY_B))
    assert tenant_a.salt is tenant_b.salt is None and None is not tenant_a.owner != tenant_b.owner
    assert ApiKeys().authenticate(None).owner is None


def test_input_items_list_the_request_input_with_ids_in_pages(server, client, other_client):
    items = [{"role": "system", "content": "Be brief."}, {"type": "message", "role": "user", "content": "One."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two."}]},
             {"role": "user", "content": "Three?"}]
    response = client.responses.create(model=NAME, input=items, max_output_tokens=2)
    page = client.responses.input_items.list(response.id, order="asc")
    assert [(i.role, [c.text for c in i.content]) for i in page.data] == [
        ("system", ["Be brief."]), ("user", ["One."]), ("assistant", ["Two."]), ("user", ["Three?"])]
    assert all(i.type == "message" and i.id.startswith("msg_") and i.status == "completed" for i in page.data)
    ids = [i.id for i in page.data]
    assert len(set(ids)) == 4 and not page.has_more
    assert [i.id for i in client.responses.input_items.list(response.id).data] == ids[::-1]  # desc by default
    body = get_json(server, f"/v1/responses/{response.id}/input_items?order=asc&limit=2&after={ids[0]}")
    assert ([i["id"] for i in body["data"]], body["first_id"], body["last_id"], body["has_more"]) == (
        ids[1:3], ids[1], ids[2], True)
    body = get_json(server, f"/v1/responses/{response.id}/input_items?order=asc&limit=2&before={ids[3]}")
    assert ([i["id"] for i in body["data"]], body["has_more"]) == (ids[1:3], True)
    text = client.responses.create(model=NAME, input="Just text.", max_output_tokens=2)
    only = client.responses.input_items.list(text.id).data
    assert [(i.role, i.content[0].type, i.content[0].text) for i in only] == [("user", "input_text", "Just text.")]
    with pytest.raises(openai.NotFoundError):
        other_client.responses.input_items.list(response.id)
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=abc", "limit"), ("order=up", "order"),
                         ("after=msg_x", "after")):
        answer = httpx.get(f"{server.url}/v1/responses/{response.id}/input_items?{query}",
                           headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, param), query


def get_json(server, path: str) -> dict:
    response = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_delete_forgets_a_response(client):
    response = client.responses.create(model=NAME, input="Forget me.", max_output_tokens=4)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_a_synchronous_response_cannot_be_cancelled(client):
    response = client.responses.create(model=NAME, input="Hi.", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(response.id)


def wait_for_status(client, response_id: str, timeout: float = 60.0):
    """Polls GET until the background response has ended (its task stores it then)."""
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.02)
    return response


def test_background_response_runs_and_is_polled(client):
    request = dict(model=NAME, input="Describe a tree.", max_output_tokens=10, temperature=0)
    queued = client.responses.create(**request, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = wait_for_status(client, queued.id)
    assert done.output_text == client.responses.create(**request).output_text
    assert client.responses.cancel(queued.id).status == done.status  # cancelling an ended one changes nothing


def test_cancel_aborts_a_background_response(server, client):
    gate, real_step = threading.Event(), server.engine.engine.step

    def gated_step():
        gate.wait(60)
        return real_step()

    server.engine.engine.step = gated_step  # no step runs until the test says so: the response cannot end first
    try:
        queued = client.responses.create(model=NAME, input="Write a long story.", max_output_tokens=200,
                                          background=True, extra_body={"ignore_eos": True})
        assert client.responses.retrieve(queued.id).status == "queued"
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled" and cancelled.output == []
    finally:
        gate.set()
        server.engine.engine.step = real_step
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # idempotent
    server.wait_idle()  # the request was aborted: its blocks are free


# ---- refused requests -----------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ({"model": "nope", "input": "x"}, 404, "model", "model_not_found"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", None),
    ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name", None),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice",
     None),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, 400, "tool_choice", None),
    ({"input": "x", "tools": [WEATHER]}, 400, "tool_choice", None),  # "auto" needs --enable-auto-tool-choice
    ({"input": "x", "background": True, "store": False}, 400, "background", "unsupported_parameter"),
    ({"input": "x", "background": True, "stream": True}, 400, "background", "unsupported_parameter"),
    ({"input": "x", "n": 2}, 400, "n", "unsupported_parameter"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
    ({"input": "x", "top_logprobs": 2}, 400, "top_logprobs", "unsupported_parameter"),
    ({"input": "x", "use_beam_search": True}, 400, "use_beam_search", "unsupported_parameter"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, 400, "stream_options", None),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400, "text.format.schema", None),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type", "invalid_value"),
    ({"input": "x", "temperature": 5}, 400, "temperature", "invalid_value"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata.k", "invalid_value"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id", "not_found"),
    ({}, 400, "input", None),
    ({"input": []}, 400, "input", None),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, 400, "input[0].type", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content[0]", None),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role", None),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id", None),
    ({"input": "x", "max_output_tokens": 10_000}, 400, "max_output_tokens", "context_length_exceeded"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", None),
    ({"input": "word " * 600}, 400, "input", None),
    ({"input": "x", "instructions": "word " * 600}, 400, "input", None),
]


@pytest.mark.parametrize("body,status,param,code", BAD_REQUESTS)
def test_bad_requests_are_refused_naming_the_field(server, body, status, param, code):
    reply = post(server, "/v1/responses", body)
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (status, param), error
    if code is not None:
        assert error["code"] == code


def test_edge_limits_and_unknown_routes(server):
    assert post(server, "/v1/responses", {"input": "x" * MAX_BODY}).status_code == 413
    assert post(server, "/v1/responses", {"input": "x"}, key="wrong").status_code == 401
    reply = httpx.get(f"{server.url}/v1/responses/resp_nope?stream=true", timeout=10,
                      headers={"Authorization": f"Bearer {KEY_A}"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"


# ---- a reasoning parser, cached tokens and a small store -----------------------------------------------------------
@pytest.fixture(scope="module")
def reasoning_server(tiny_llama_dir):
    from paged_runtime.entrypoints.openai.serving_chat import ChatOptions
    with running_server(tiny_llama_dir, "tiny-r1", max_model_len=256, block_size=BLOCK_SIZE,
                        kv_cache_memory=8 * 2**20,
                        app_options={"chat_options": ChatOptions(reasoning_parser="deepseek_r1"),
                                     "enable_prompt_tokens_details": True,
                                     "responses_store_max_entries": 2}) as server:
        yield server


def test_reasoning_items_tokens_cached_tokens_and_the_store_bound(reasoning_server):
    """deepseek_r1: the tiny model never writes </think>, so all of its output is reasoning (as chat says)."""
    client = openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    request = dict(model="tiny-r1", input="Think about the sea.", max_output_tokens=12, temperature=0)
    response = client.responses.create(**request)
    chat = client.chat.completions.create(model="tiny-r1", messages=[{"role": "user", "content": request["input"]}],
                                          max_completion_tokens=12, temperature=0)
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 12
    events = list(client.responses.create(**request, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert events[-1].response.output[0].content == reasoning.content
    # The same prompt again: its full blocks (all but the last token's) come from the prefix cache.
    again = client.responses.create(**request)
    num_input = again.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == (num_input - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    # At most 2 stored responses: the least recently used goes.
    third = client.responses.create(**request)
    client.responses.retrieve(again.id)  # now more recent than the stream's response
    fourth = client.responses.create(**request)
    for gone in (response, events[-1].response, third):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone.id)
    assert [client.responses.retrieve(r.id).id for r in (again, fourth)] == [again.id, fourth.id]


# ---- the store's bounds, exactly ---------------------------------------------------------------------------------
def test_entry_size_is_its_compact_json():
    assert entry_size({"id": "a"}, []) == len('[{"id":"a"},[]]') == 15
    assert entry_size({"t": "é"}, [{"role": "user"}]) == len('[{"t":"é"},[{"role":"user"}]]'.encode())


def test_store_evicts_the_least_recently_used_beyond_its_count():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for name in "abc":
        assert store.put("owner", name, {"id": name}, [])
    assert store.get("owner", "a") is not None  # a is now the most recent: b goes first
    store.put("owner", "d", {"id": "d"}, [])
    assert [store.get("owner", n) is not None for n in "abcd"] == [True, False, True, True]
    assert (len(store), store.num_bytes) == (3, 45)
    assert store.get("someone else", "a") is None and store.get(None, "a") is None


def test_store_evicts_beyond_its_bytes_and_refuses_what_never_fits():
    store = ResponseStore(max_entries=100, max_bytes=45)
    for name in "abc":
        store.put(None, name, {"id": name}, [])  # 15 bytes each: exactly full
    assert (len(store), store.num_bytes) == (3, 45)
    assert entry_size({"id": "d"}, [{"r": 1}]) == 22
    store.put(None, "d", {"id": "d"}, [{"r": 1}])  # 45 + 22 > 45: a goes, then b
    assert [store.get(None, n) is not None for n in "abcd"] == [False, False, True, True]
    assert store.num_bytes == 37
    assert not store.put(None, "big", {"id": "x" * 40}, [])  # 54 bytes > 45: not kept, nothing evicted
    assert (len(store), store.num_bytes) == (2, 37)
    store.put(None, "c", {"id": "c", "s": 1}, [])  # replacing an entry recounts its bytes: 37 - 15 + 21
    assert (len(store), store.num_bytes) == (2, 43)
    assert store.delete(None, "c") and not store.delete(None, "c") and store.num_bytes == 22
    assert not ResponseStore(0, 100).put(None, "a", {}, [])  # 0 entries: storing is off


def test_the_store_settings_reach_the_router():
    from paged_runtime.config import ServerConfig
    from paged_runtime.entrypoints.openai import app_options
    options = app_options(ServerConfig(responses_store_max_entries=7, responses_store_max_bytes=2**20))
    assert (options["responses_store_max_entries"], options["responses_store_max_bytes"]) == (7, 2**20)
    with pytest.raises(ValueError, match="responses_store_max_entries must be non-negative"):
        ServerConfig(responses_store_max_entries=-1)
