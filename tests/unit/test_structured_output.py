"""The grammar backend (compile once, cache by key, the compiler's message in the error) and one request's
grammar state (it follows the token history: appends, rewinds, the reasoning gate, speculative masks that
leave the matcher where it was, a refused token)."""
from __future__ import annotations

import pytest
import torch

from paged_runtime.sampling_params import ParameterError, StructuredOutputsParams
from paged_runtime.sample.sampler import apply_token_bitmask
from paged_runtime.structured_output.backend import GrammarBackend, constraint_key
from paged_runtime.structured_output.grammar import RequestGrammar

VOCAB, EOS = 49152, 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, VOCAB, [EOS])


def allowed(grammar: RequestGrammar) -> set[int]:
    bitmask = torch.full((1, -(-VOCAB // 32)), -1, dtype=torch.int32)
    grammar.fill(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    apply_token_bitmask(logits, [0], bitmask)
    return set(torch.isfinite(logits[0]).nonzero().squeeze(1).tolist())


def grammar_for(backend, choices, after=()) -> RequestGrammar:
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=choices)))
    return RequestGrammar(matcher, tuple(after))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_equal_constraints_compile_once_and_keep_their_key_order(backend):
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    before = backend.stats.num_compiled, backend.stats.num_hits
    first = backend.compile(StructuredOutputsParams(json=schema))
    again = backend.compile(StructuredOutputsParams(json=dict(schema)))
    assert first is again
    assert (backend.stats.num_compiled, backend.stats.num_hits) == (before[0] + 1, before[1] + 1)
    assert constraint_key(StructuredOutputsParams(json=schema)) == ("json", '{"type": "object", "properties": '
                                                                          '{"b": {"type": "integer"}, "a": {"type": '
                                                                          '"integer"}}}')
    spaced = constraint_key(StructuredOutputsParams(json=schema, any_whitespace=True))
    assert spaced[0] == "json+whitespace"


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(regex="a(b"), "parenthesis is not closed"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
    (StructuredOutputsParams(json='{"type": "objectx"}'), 'Unsupported type "objectx"'),
    (StructuredOutputsParams(json="{nope"), "Expecting property name"),
])
def test_a_bad_constraint_is_a_parameter_error_with_the_compilers_message(backend, constraint, message):
    with pytest.raises(ParameterError, match=message) as raised:
        backend.compile(constraint, "guided_x")
    assert raised.value.param == "guided_x"
    assert "/project/" not in str(raised.value) and ".cc:" not in str(raised.value)  # no C++ source location


def test_structured_outputs_params_take_exactly_one_kind():
    with pytest.raises(ParameterError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ParameterError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ParameterError, match="non-empty"):
        StructuredOutputsParams(choice=[])


def test_the_grammar_follows_appends_and_rewinds(backend, tokenizer):
    grammar = grammar_for(backend, ["red apple", "red pear"])
    prompt = [5, 6, 7]
    red, apple, pear = ids(tokenizer, "red"), ids(tokenizer, " apple"), ids(tokenizer, " pear")
    grammar.sync(prompt, len(prompt))
    assert grammar.active and red[0] in allowed(grammar) and EOS not in allowed(grammar)
    history = prompt + red + apple
    grammar.sync(history, len(prompt))
    assert allowed(grammar) == {EOS}  # "red apple" is complete
    grammar.rewind(len(prompt) + len(red))  # the history was rewritten from " apple" on (a beam's choice)
    grammar.sync(prompt + red + pear, len(prompt))
    assert grammar.accepted == red + pear and allowed(grammar) == {EOS}
    grammar.rewind(1)  # a rewrite inside the prompt: back to the start
    grammar.sync(prompt, len(prompt))
    assert grammar.accepted == [] and red[0] in allowed(grammar)


def test_the_constraint_starts_after_the_reasoning_end_marker(backend, tokenizer):
    marker = ids(tokenizer, "</think>")
    assert len(marker) > 1  # SmolLM2 has no such token: the gate must match a sequence
    grammar = grammar_for(backend, ["yes", "no"], after=marker)
    prompt = [5, 6]
    thinking = ids(tokenizer, "let me think")
    history = prompt + thinking + marker[:1]
    grammar.sync(history, len(prompt))
    assert not grammar.active  # the marker is not complete: no mask yet
    history += marker[1:]
    grammar.sync(history, len(prompt))
    assert grammar.active and grammar.start == len(history)
    assert ids(tokenizer, "yes")[0] in allowed(grammar) and thinking[0] not in allowed(grammar)


def test_speculative_masks_leave_the_matcher_where_it_was(backend, tokenizer):
    grammar = grammar_for(backend, ["red apple"])
    prompt = [5]
    grammar.sync(prompt, 1)
    red, apple = ids(tokenizer, "red"), ids(tokenizer, " apple")
    drafts = red + apple + [EOS]
    bitmask = torch.full((len(drafts) + 1, -(-VOCAB // 32)), -1, dtype=torch.int32)
    grammar.fill_speculative(bitmask, 0, drafts)
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    apply_token_bitmask(logits, list(range(len(drafts) + 1)), bitmask)
    for row, draft in enumerate(drafts):
        assert torch.isfinite(logits[row, draft]), f"draft {row} is what the grammar allows there"
    assert grammar.accepted == [] and red[0] in allowed(grammar)  # rolled back
    refused = [ids(tokenizer, "blue")[0], red[0]]
    bitmask[:] = -1
    grammar.fill_speculative(bitmask, 0, refused)
    logits = torch.zeros(3, VOCAB)
    apply_token_bitmask(logits, [0, 1, 2], bitmask)
    assert not torch.isfinite(logits[0, refused[0]])  # the first draft masks itself out: it will be rejected
    assert grammar.accepted == [] and red[0] in allowed(grammar)


def test_a_refused_history_token_allows_only_stop_tokens(backend, tokenizer):
    grammar = grammar_for(backend, ["yes"])
    prompt = [5]
    grammar.sync(prompt + ids(tokenizer, "blue"), 1)
    assert grammar.failed and allowed(grammar) == {EOS}
    grammar.rewind(1)  # the history is rewritten: the refused token is gone
    grammar.sync(prompt + ids(tokenizer, "yes"), 1)
    assert not grammar.failed and allowed(grammar) == {EOS}


def test_a_stop_token_id_31_sets_the_sign_bit():
    from paged_runtime.structured_output.grammar import _only_stop_tokens
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    _only_stop_tokens(bitmask, 0, [31, 33])
    logits = torch.zeros(1, 64)
    apply_token_bitmask(logits, [0], bitmask)
    assert torch.isfinite(logits[0]).nonzero().squeeze(1).tolist() == [31, 33]
