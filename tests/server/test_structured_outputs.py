"""Structured outputs and tool calling through real clients against the embedded SmolLM2.

One server, n-gram speculative decoding on (drafts the grammar refuses must be rejected), auto tool choice
with the hermes parser. Every constrained output must parse and validate, whatever the model would have
written: the grammar, not the model, guarantees it. Streaming must put together what a whole response says.
"""
from __future__ import annotations

import enum
import json
import re
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import running_server

NAME = "smol-structured"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}


# Every field is bounded (string lengths, integer ranges, list sizes), so any valid object fits in the tests'
# max_completion_tokens: they check parsing and streaming, not where a sampled 135M model chooses to stop
# (an unbounded int or string let one sampled completion run to the limit when the kernels' arithmetic moved).
Tag = Annotated[str, pydantic.Field(max_length=20)]


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=150)
    address: Address


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Palette(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    colors: list[Color] = pydantic.Field(max_length=3)


class Book(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=30)
    year: int | None = pydantic.Field(ge=0, le=2100)
    tags: list[Tag] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def server(smollm2_dir):
    from paged_runtime.entrypoints.openai.serving_chat import ChatOptions
    with running_server(smollm2_dir, NAME, max_model_len=1024, kv_cache_memory=64 * 2**20, speculative_config=SPEC,
                        app_options={"chat_options": ChatOptions(True, "hermes")}) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("model, prompt", [
    (Person, "Invent a person with an address."),
    (Palette, "Name a palette of colors."),
    (Book, "Describe a book."),
], ids=["nested", "array-enum", "optional"])
@pytest.mark.slow
def test_parse_returns_valid_objects_whole_and_streamed_with_n_2(client, model, prompt):
    completion = client.chat.completions.parse(model=NAME, messages=ask(prompt), response_format=model, n=2,
                                               temperature=0.8, seed=7, max_completion_tokens=200)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)
    with client.chat.completions.stream(model=NAME, messages=ask(prompt), response_format=model,
                                        temperature=0, max_completion_tokens=200) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, model)
    whole = client.chat.completions.parse(model=NAME, messages=ask(prompt), response_format=model, temperature=0,
                                          max_completion_tokens=200)
    assert whole.choices[0].message.content == final.choices[0].message.content  # greedy: the same text


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}",
     lambda text: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}", text)),
    ("guided_choice", ["Paris", "London", "Rome"], lambda text: text in ("Paris", "London", "Rome")),
    ("guided_grammar", 'root ::= "The answer is " ("yes" | "no") "."',
     lambda text: text in ("The answer is yes.", "The answer is no.")),
    ("structured_outputs", {"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ("structured_outputs", {"regex": "[0-9]{4}"}, lambda text: re.fullmatch("[0-9]{4}", text)),
], ids=["regex", "choice", "grammar", "json_object", "structured_outputs-regex"])
def test_every_constrained_output_matches_on_both_routes(client, field, value, check):
    chat = client.chat.completions.create(model=NAME, messages=ask("Answer the question: what city?"), n=2,
                                          temperature=1.0, seed=3, max_completion_tokens=60,
                                          extra_body={field: value})
    completion = client.completions.create(model=NAME, prompt="My answer:", temperature=0, max_tokens=60,
                                           extra_body={field: value})
    texts = [c.message.content for c in chat.choices] + [completion.choices[0].text]
    for text, reason in zip(texts, [c.finish_reason for c in chat.choices] + [completion.choices[0].finish_reason]):
        if reason == "length" and field == "structured_outputs" and "json_object" in value:
            # Any JSON may run past the limit (greedy, this 135M model loops inside a string: '{"2018-01-01T00:00:
            # 00-00:00-00:00...'): then what came must be the start of an object.
            assert json_prefix_closes(text), text
            continue
        assert reason == "stop", text
        assert check(text), text


def json_prefix_closes(text: str) -> bool:
    """Whether ``text`` is the start of a JSON object: closing its open string, value and brackets parses."""
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    body = text + ('"' if in_string else "")
    closer = "".join(reversed(stack))
    return text.startswith("{") and any(_parses(body.rstrip().rstrip(",") + tail + closer)
                                        for tail in ("", ": null", "null"))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_response_format_json_object_parses(client):
    response = client.chat.completions.create(model=NAME, messages=ask("Describe a cat as a JSON object with name and age."),
                                              response_format={"type": "json_object"}, temperature=0,
                                              max_completion_tokens=150)
    assert isinstance(json.loads(response.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_parse_validate_and_stream_the_same(client, tool_choice):
    tools = [WEATHER, TIME]
    messages = ask("What is the weather in Paris?")
    whole = client.chat.completions.create(model=NAME, messages=messages, tools=tools, tool_choice=tool_choice,
                                           temperature=0, max_completion_tokens=150)
    choice = whole.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert choice.message.content is None and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    streamed = _stream_tool_calls(client, messages, tools, tool_choice)
    assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def _stream_tool_calls(client, messages, tools, tool_choice) -> list[tuple[str, str]]:
    """The calls of a streamed response, put together from their deltas as OpenAI's clients do."""
    calls: dict[int, list] = {}
    finish = None
    for chunk in client.chat.completions.create(model=NAME, messages=messages, tools=tools, tool_choice=tool_choice,
                                                temperature=0, max_completion_tokens=150, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, [None, ""])
                if delta.function.name:
                    entry[0] = delta.function.name
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    return [tuple(calls[i]) for i in sorted(calls)]


def test_tool_role_round_trip(client):
    first = client.chat.completions.create(model=NAME, messages=ask("Weather in Rome?"), tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_completion_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    history = ask("Weather in Rome?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_completion_tokens=30)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_auto_tool_choice_without_a_call_is_content(client):
    response = client.chat.completions.create(model=NAME, messages=ask("Say hello."), tools=[WEATHER],
                                              temperature=0, max_completion_tokens=20)
    choice = response.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_langchain_structured_output_and_bound_tools(server):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=NAME, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=150,
                     max_retries=0, timeout=120)
    person = llm.with_structured_output(Person).invoke("Invent a person with an address.")
    assert isinstance(person, Person)
    message = llm.bind_tools([WEATHER, TIME], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    anything = llm.bind_tools([WEATHER, TIME], tool_choice="any").invoke("What time is it in Tokyo?")
    assert anything.tool_calls and {c["name"] for c in anything.tool_calls} <= {"get_weather", "get_time"}


@pytest.fixture(scope="module")
def reasoning_server(tiny_llama_dir):
    from paged_runtime.entrypoints.openai.serving_chat import ChatOptions
    with running_server(tiny_llama_dir, "tiny-r1", max_model_len=256, kv_cache_memory=8 * 2**20,
                        app_options={"chat_options": ChatOptions(reasoning_parser="deepseek_r1")}) as server:
        yield server


def test_reasoning_parser_splits_whole_and_streamed_responses_alike(reasoning_server):
    """deepseek_r1: with no </think> in the output (the tiny model never writes one), all of it is reasoning;
    a constraint waits for the marker, so it does not apply either; include_reasoning false drops it."""
    client = openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0)
    body = dict(model="tiny-r1", messages=ask("Think."), temperature=0, max_completion_tokens=12)
    whole = client.chat.completions.create(**body, extra_body={"guided_choice": ["yes", "no"]})
    message = whole.choices[0].message
    assert message.content is None and message.reasoning_content and message.reasoning_content not in ("yes", "no")
    chunks = client.chat.completions.create(**body, stream=True, extra_body={"guided_choice": ["yes", "no"]})
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert reasoning == message.reasoning_content
    hidden = client.chat.completions.create(**body, extra_body={"include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    assert hidden.choices[0].message.content is None
