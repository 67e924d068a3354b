"""Reasoning parsers: exact (reasoning, content) per format, streaming that agrees with extract for every
split of the text (markers cut anywhere), the end-of-reasoning helpers, unknown names."""
from __future__ import annotations

import pytest

from paged_runtime.entrypoints.openai.reasoning_parsers import (REASONING_PARSERS, ReasoningDelta,
                                                                get_reasoning_parser)

# name -> [(model text, reasoning, content)]
CASES = {
    "deepseek_r1": [
        ("<think>Add them.</think>\n\nIt is 4.", "Add them.", "\n\nIt is 4."),
        ("Add them.</think>It is 4.", "Add them.", "It is 4."),  # the template opened <think>
        ("\n<think>\nhmm</think>", "\nhmm", None),
        ("Still thinking when cut off", "Still thinking when cut off", None),  # no </think>: all reasoning
        ("<think>cut off", "cut off", None),
        ("</think>Only content", None, "Only content"),
        ("a <think> b</think>c", "a <think> b", "c"),  # only a leading <think> is dropped
        ("<thin", "<thin", None),
        ("x</think>y</think>z", "x", "y</think>z"),
        ("", None, None),
    ],
    "qwen3": [
        ("<think>\nAdd them.\n</think>\n\nIt is 4.", "\nAdd them.\n", "\n\nIt is 4."),
        ("It is 4.", None, "It is 4."),  # no <think>: all content
        ("It is 4.</think>", None, "It is 4.</think>"),
        ("\n<think>hmm</think>ok", "hmm", "\nok"),
        ("<think>cut off while thinking", "cut off while thinking", None),
        ("<think></think>\n\nok", None, "\n\nok"),  # thinking switched off by the template
        ("a <thin", None, "a <thin"),
        ("<think>a</thi", "a</thi", None),
        ("", None, None),
    ],
}
EXTRACT_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("name, text, reasoning, content", EXTRACT_CASES)
def test_extract_splits_reasoning_from_content(name, text, reasoning, content):
    assert get_reasoning_parser(name).extract(text) == (reasoning, content)


def stream_in(name: str, deltas: list[str]) -> list[ReasoningDelta]:
    stream = get_reasoning_parser(name).stream()
    return [stream.feed(d) for d in deltas] + [stream.finish()]


def joined(out: list[ReasoningDelta]) -> tuple[str, str]:
    return "".join(d.reasoning for d in out), "".join(d.content for d in out)


@pytest.mark.parametrize("name, text, reasoning, content", EXTRACT_CASES)
def test_streaming_agrees_with_extract_at_every_split(name, text, reasoning, content):
    want = (reasoning or "", content or "")
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 4)):
            assert joined(stream_in(name, [text[:cut], text[cut:cut2], text[cut2:]])) == want, (cut, cut2)
    assert joined(stream_in(name, list(text))) == want  # one character at a time


def test_a_marker_split_across_deltas_is_held_until_resolved():
    out = stream_in("deepseek_r1", ["<th", "ink>Add", " them.</th", "ink>It", " is 4."])
    assert out == [("", ""), ("Add", ""), (" them.", ""), ("", "It"), ("", " is 4."), ("", "")]
    out = stream_in("deepseek_r1", ["so </th", "is is not the end"])
    assert out == [("so ", ""), ("</this is not the end", ""), ("", "")]
    out = stream_in("qwen3", ["Hi <thi", "nk>hmm</", "think>ok"])
    assert out == [("", "Hi "), ("hmm", ""), ("", "ok"), ("", "")]
    assert stream_in("qwen3", ["a <thi"]) == [("", "a "), ("", "<thi")]  # released at the end


def test_reasoning_ended_after_the_last_open_section_closes():
    parser = get_reasoning_parser("deepseek_r1")
    assert parser.end_marker == "</think>" and parser.start_marker == "<think>"
    assert not parser.reasoning_ended("")
    assert not parser.reasoning_ended("<think>still going")
    assert parser.reasoning_ended("done</think>")  # opened by the template
    assert parser.reasoning_ended("<think></think>\n\n")  # Qwen3's prompt with thinking off
    assert not parser.reasoning_ended("<think>a</think>b<think>c")  # a new section is open


def test_end_token_ids_encodes_the_end_marker_without_special_tokens():
    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return {"</think>": [151668]}[text]

    assert get_reasoning_parser("qwen3").end_token_ids(Tokenizer()) == [151668]


def test_an_unknown_parser_name_lists_the_known_ones():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'granite'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
