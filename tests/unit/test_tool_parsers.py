"""Tool-call parsers: exact calls and content per format (several calls, content before calls, malformed
JSON left as content, arguments given as a JSON string), and streaming that agrees with extract for
every split of the text into deltas."""
from __future__ import annotations

import json
import re

import pytest

from paged_runtime.entrypoints.openai.tool_parsers import (TOOL_PARSERS, ExtractedToolCalls, StreamDelta, ToolCall,
                                                           get_tool_parser, partial_marker_len)

WEATHER = {"city": "Paris", "unit": "°C"}
WEATHER_JSON = json.dumps(WEATHER, ensure_ascii=False)  # '{"city": "Paris", "unit": "°C"}'


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in result.tool_calls]


# name -> [(model text, expected calls, expected content)]
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>',
         [("get_weather", WEATHER_JSON)], None),
        ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
         '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
         [("a", '{"x": 1}'), ("b", "{}")], "Let me check.\n\n"),
        # arguments as a JSON string are kept as that string
        ('<tool_call>{"name": "a", "arguments": "{\\"x\\":1}"}</tool_call>', [("a", '{"x":1}')], None),
        # an unclosed last block whose JSON is whole still counts (the model stopped after it)
        ('<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n', [("a", '{"x": [1, 2]}')], None),
        # a block that does not parse stays as text; the good one is still a call
        ('<tool_call>{"name": "a", "arguments": {"x": </tool_call> and <tool_call>{"name": "b"}</tool_call>',
         [("b", "{}")], '<tool_call>{"name": "a", "arguments": {"x": </tool_call> and '),
        ('no calls here, only <tool_ talk', [], 'no calls here, only <tool_ talk'),
        ('<tool_call>{"arguments": {}}</tool_call>', [], '<tool_call>{"arguments": {}}</tool_call>'),
        ('<tool_call>{"name": "a", "arguments": "not json"}</tool_call>', [],
         '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>'),
        ('<tool_call>{"name": "a", "arguments": "[1, 2]"}</tool_call>', [],  # JSON, but not an object
         '<tool_call>{"name": "a", "arguments": "[1, 2]"}</tool_call>'),
        ("", [], None),
        ("   \n", [], None),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}',
         [("get_weather", WEATHER_JSON)], None),
        ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}',
         [("a", '{"x": 1}'), ("b", '{"y": "z"}')], None),
        ('\n {"name": "a", "parameters": "{\\"x\\": 2}"}', [("a", '{"x": 2}')], None),
        ('{"name": "a", "parameters": {"x": 1}} and then some words',
         [], '{"name": "a", "parameters": {"x": 1}} and then some words'),
        ('{"name": "a", "parameters": {"x": ', [], '{"name": "a", "parameters": {"x": '),
        ('The answer is {"name": "a", "parameters": {}}', [], 'The answer is {"name": "a", "parameters": {}}'),
        ('<|python_tag|>print(1)', [], '<|python_tag|>print(1)'),
        ('<|python_t', [], '<|python_t'),
        ('{"answer": 42}', [], '{"answer": 42}'),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]',
         [("get_weather", WEATHER_JSON)], None),
        ('Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{}"}]',
         [("a", '{"x": 1}'), ("b", "{}")], "Sure."),
        ('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', [("a", '{"x": 1}'), ("b", "{}")], None),
        ('Hi [TOOL_CALLS] [{"name": "a", "arguments": {"x": ]', [],
         'Hi [TOOL_CALLS] [{"name": "a", "arguments": {"x": ]'),
        ('[TOOL_CALLS]a[ARGS]{"x": 1} trailing words', [], '[TOOL_CALLS]a[ARGS]{"x": 1} trailing words'),
        ('[TOOL_CALLS]', [], '[TOOL_CALLS]'),
        ('plain answer, no [TOOL_ marker', [], 'plain answer, no [TOOL_ marker'),
    ],
}
EXTRACT_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("name, text, calls, content", EXTRACT_CASES)
def test_extract_finds_the_exact_calls_and_content(name, text, calls, content):
    result = get_tool_parser(name).extract(text)
    assert calls_of(result) == calls
    assert result.content == content


def test_a_call_has_an_openai_style_id_of_its_own():
    result = get_tool_parser("hermes").extract(CASES["hermes"][1][0])
    ids = [c.id for c in result.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2
    assert re.fullmatch(r"call_[0-9a-f]{24}", ToolCall("f", "{}").id)


def stream_in(name: str, deltas: list[str]) -> tuple[str, list[tuple[int, str, str]], list[StreamDelta]]:
    stream = get_tool_parser(name).stream()
    out = [stream.feed(d) for d in deltas] + [stream.finish()]
    content = "".join(d.content for d in out)
    calls = [(c.index, c.name, c.arguments) for d in out for c in d.tool_calls]
    return content, calls, out


@pytest.mark.parametrize("name, text, calls, content", EXTRACT_CASES)
def test_streaming_agrees_with_extract_at_every_split(name, text, calls, content):
    want_calls = [(i, n, a) for i, (n, a) in enumerate(calls)]
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 3)):  # two and three deltas, an empty one among them
            got_content, got_calls, _ = stream_in(name, [text[:cut], text[cut:cut2], text[cut2:]])
            assert (got_content, got_calls) == (content or "", want_calls), (cut, cut2)
    got_content, got_calls, _ = stream_in(name, list(text))  # one character at a time
    assert (got_content, got_calls) == (content or "", want_calls)


def test_streaming_releases_plain_text_at_once_and_holds_a_possible_marker():
    content, _, out = stream_in("hermes", ["Hello <tool", "_call>", '{"name": "f"}', "</tool_call>"])
    assert [d.content for d in out] == ["Hello ", "", "", "", ""]
    assert [(c.index, c.name, c.arguments) for c in out[3].tool_calls] == [(0, "f", "{}")]  # when it closes
    _, _, out = stream_in("mistral", ["It is ", "sunny.", " [TOOL"])
    assert [d.content for d in out] == ["It is ", "sunny.", " ", "[TOOL"]  # the unfinished marker at the end
    _, _, out = stream_in("llama3_json", ["The ", "answer"])
    assert [d.content for d in out] == ["The ", "answer", ""]
    _, calls, out = stream_in("llama3_json", [" {", '"name": "f", "parameters": {}}'])
    assert [d.content for d in out] == ["", "", ""] and calls == [(0, "f", "{}")]  # whole output decided at the end


def test_partial_marker_len_is_the_longest_tail_that_starts_the_marker():
    assert partial_marker_len("abc<tool_c", "<tool_call>") == 7
    assert partial_marker_len("abc<", "<tool_call>") == 1
    assert partial_marker_len("abc", "<tool_call>") == 0
    assert partial_marker_len("<tool_call>", "<tool_call>") == 0  # a whole marker is found, not held


BAD_OUTPUTS = ("<tool_call>", "[TOOL_CALLS][[[", "{" * 5000, "}{", "<|python_tag|>", '{"name": 3}', "\x00",
               "[TOOL_CALLS]" + "[" * 100_000, '[TOOL_CALLS]f[ARGS]"' + "[" * 100_000 + '"',  # too deep
               '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "</tool_call>")


def test_a_parser_never_raises_on_its_input(caplog):
    for name in TOOL_PARSERS:
        for text in BAD_OUTPUTS:
            result = get_tool_parser(name).extract(text)
            assert result.tool_calls == [] and result.content == text
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # handled as text, not as a parser bug


def test_an_unknown_parser_name_lists_the_known_ones():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match=r"unknown tool call parser 'pythonic'; known: hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")
    assert get_tool_parser("hermes", tokenizer="tok").tokenizer == "tok"


def test_each_parser_names_its_markers_so_the_route_can_keep_special_tokens():
    assert {name: cls.markers for name, cls in TOOL_PARSERS.items()} == {
        "hermes": ("<tool_call>", "</tool_call>"), "llama3_json": ("<|python_tag|>",),
        "mistral": ("[TOOL_CALLS]", "[ARGS]")}
