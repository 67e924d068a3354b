"""A chat choice's text as OpenAI's message fields (chat_output.ChoiceText): reasoning first, then content
or tool calls by tool choice; a stream's deltas, split anywhere, put together equal the whole response."""
from __future__ import annotations

import json

import pytest

from paged_runtime.entrypoints.openai.chat_output import ChoiceText
from paged_runtime.entrypoints.openai.protocol import ChatTool
from paged_runtime.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from paged_runtime.entrypoints.openai.tool_calls import ToolChoice
from paged_runtime.entrypoints.openai.tool_parsers import get_tool_parser

WEATHER = ChatTool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})
NAMED, REQUIRED, AUTO, NONE = (ToolChoice("named", WEATHER), ToolChoice("required"), ToolChoice("auto"),
                               ToolChoice("none"))
HERMES_TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parser(choice: ToolChoice, reasoning: str | None = None, include_reasoning: bool = True) -> ChoiceText:
    return ChoiceText(choice, get_tool_parser("hermes") if choice.mode == "auto" else None,
                      get_reasoning_parser(reasoning) if reasoning else None, include_reasoning)


def streamed(choice: ToolChoice, text: str, cuts: list[int], **kwargs) -> tuple[dict, bool]:
    """The deltas of ``text`` cut at ``cuts``, put together as a client does: strings joined, calls by index."""
    p = parser(choice, **kwargs)
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    deltas = [p.feed(piece) for piece in pieces if piece] + [p.finish()]
    joined: dict = {}
    calls: dict[int, dict] = {}
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            if key in delta:
                joined[key] = joined.get(key, "") + delta[key]
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call["function"]["arguments"]
    if calls:
        joined["tool_calls"] = [calls[i] for i in sorted(calls)]
    return joined, p.tools_called


def whole(choice: ToolChoice, text: str, **kwargs) -> tuple[dict, bool]:
    p = parser(choice, **kwargs)
    message = p.whole(text)
    out = {k: v for k, v in message.items() if v is not None and k != "tool_calls"}
    if "tool_calls" in message:
        out["tool_calls"] = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                             for c in message["tool_calls"]]
    return out, p.tools_called


CASES = [
    (NAMED, '{"city": "Paris"}', {}, {"tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}),
    (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", '
               '"parameters": {"city": "Rome"}}]', {},
     {"tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     {"name": "get_weather", "arguments": '{"city": "Rome"}'}]}),
    (AUTO, HERMES_TEXT, {}, {"content": "Let me check.",
                             "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}),
    (AUTO, "Just text, no call.", {}, {"content": "Just text, no call."}),
    (AUTO, "<think>hmm</think>" + HERMES_TEXT, {"reasoning": "qwen3"},
     {"reasoning_content": "hmm", "content": "Let me check.",
      "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}),
    (NONE, "<think>a</think>b", {"reasoning": "qwen3", "include_reasoning": False}, {"content": "b"}),
    (NONE, "thinking</think>answer", {"reasoning": "deepseek_r1"},
     {"reasoning_content": "thinking", "content": "answer"}),
]


@pytest.mark.parametrize("choice, text, kwargs, expected", CASES,
                         ids=["named", "required", "auto", "auto-text", "reasoning-auto", "no-reasoning", "r1"])
def test_whole_and_every_two_way_split_of_a_stream_agree(choice, text, kwargs, expected):
    message, called = whole(choice, text, **kwargs)
    assert message == expected
    assert called == ("tool_calls" in expected)
    for cut in range(1, len(text)):
        assert streamed(choice, text, [cut], **kwargs) == (expected, called), cut


def test_one_character_at_a_time(choice=REQUIRED):
    text = CASES[1][1]
    assert streamed(choice, text, list(range(1, len(text))))[0] == CASES[1][3]


def test_the_named_calls_first_delta_carries_its_id_name_and_type():
    p = parser(NAMED)
    first, second = p.feed('{"city": '), p.feed('"Rome"}')
    call = first["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert second["tool_calls"] == [{"index": 0, "function": {"arguments": '"Rome"}'}}]


def test_forced_output_cut_short_is_returned_as_content():
    message = parser(REQUIRED).whole('[{"name": "get_weather", "param')
    assert message["content"] == '[{"name": "get_weather", "param' and "tool_calls" not in message
    message = parser(NAMED).whole('{"city": "Par')
    assert message["content"] == '{"city": "Par' and "tool_calls" not in message
    assert json.loads(parser(NAMED).whole('{"city": "Paris"}')["tool_calls"][0]["function"]["arguments"])
