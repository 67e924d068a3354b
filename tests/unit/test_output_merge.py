"""Coalescing a slow reader's outputs: ``merge_outputs`` (pure) and ``RequestStream`` holding one pending item."""
from __future__ import annotations

import asyncio
import copy

import pytest

from paged_runtime.engine.async_engine import RequestStream, merge_outputs
from paged_runtime.engine.client import EngineDeadError, RequestFailedError
from paged_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from paged_runtime.sampling_params import RequestOutputKind

DELTA, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE


def lp(token_id: int) -> dict:
    return {token_id: Logprob(-0.5, 1, str(token_id))}


def delta(index: int, text: str, token_ids: list[int], finish_reason: str | None = None) -> CompletionOutput:
    """A DELTA completion: text, ids and logprobs hold only this step's part (as do the delta fields)."""
    logprobs = [lp(t) for t in token_ids]
    return CompletionOutput(index, text, list(token_ids), -1.0, logprobs, finish_reason, None,
                            text, list(token_ids), list(logprobs))


def cumulative(index: int, text: str, token_ids: list[int], new: int, finish_reason: str | None = None):
    """A CUMULATIVE completion: everything so far, and its last ``new`` tokens (1 char each) as the delta."""
    return CompletionOutput(index, text, list(token_ids), -1.0, [lp(t) for t in token_ids], finish_reason, None,
                            text[len(text) - new:], token_ids[len(token_ids) - new:],
                            [lp(t) for t in token_ids[len(token_ids) - new:]])


def output(*completions: CompletionOutput, finished: bool = False, error: str | None = None) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2], list(completions), finished, None, 0, error)


def test_delta_concatenates_per_index_and_keeps_sequences_that_did_not_move():
    older = output(delta(0, "ab", [1, 2]), delta(1, "x", [9]))
    newer = output(delta(1, "yz", [8, 7], "stop"))
    before = copy.deepcopy((older, newer))
    merged = merge_outputs(older, newer, DELTA)
    assert (older, newer) == before, "the inputs are left as they were"
    first, second = merged.outputs
    assert (first.index, first.text, first.token_ids, first.delta_text) == (0, "ab", [1, 2], "ab")
    assert (second.index, second.text, second.token_ids, second.finish_reason) == (1, "xyz", [9, 8, 7], "stop")
    assert second.logprobs == [lp(9), lp(8), lp(7)] == second.delta_logprobs
    assert (second.delta_text, second.delta_token_ids) == ("xyz", [9, 8, 7])


def test_cumulative_takes_the_newer_state_and_keeps_every_delta():
    older = output(cumulative(0, "ab", [1, 2], 2), cumulative(1, "x", [9], 1))
    newer = output(cumulative(0, "abc", [1, 2, 3], 1), finished=False)
    merged = merge_outputs(older, newer, CUMULATIVE)
    first, second = merged.outputs
    assert (first.text, first.token_ids, first.delta_text, first.delta_token_ids) == ("abc", [1, 2, 3], "abc", [1, 2, 3])
    assert first.logprobs == [lp(1), lp(2), lp(3)] == first.delta_logprobs
    assert second == older.outputs[1]


def test_newer_request_fields_win():
    older = output(delta(0, "a", [1]))
    newer = output(delta(0, "", [], "error"), finished=True, error="boom")
    merged = merge_outputs(older, newer, DELTA)
    assert (merged.finished, merged.error, merged.outputs[0].finish_reason, merged.outputs[0].text) == (
        True, "boom", "error", "a")


def test_a_cumulative_final_output_is_the_whole_answer():
    """best_of > n: the final output holds the n best, re-indexed; earlier candidates are not carried over."""
    older = output(cumulative(0, "a", [1], 1), cumulative(2, "c", [3], 1))
    newer = output(cumulative(0, "cd", [3, 4], 1, "length"), finished=True)
    merged = merge_outputs(older, newer, CUMULATIVE)
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "cd")]


def test_n_steps_of_deltas_merge_into_their_concatenation():
    pending, texts = None, []
    for step in range(50):
        piece = delta(step % 2, f"<{step}>", [step])
        texts.append(piece.text)
        new = output(piece, finished=step == 49)
        pending = new if pending is None else merge_outputs(pending, new, DELTA)
    assert [c.text for c in pending.outputs] == ["".join(texts[0::2]), "".join(texts[1::2])]
    assert [c.token_ids for c in pending.outputs] == [list(range(0, 50, 2)), list(range(1, 50, 2))]
    assert pending.finished


class FakeEngine:
    def __init__(self):
        self.aborted = []

    def _abort_key(self, key):
        self.aborted.append(key)


def test_stream_holds_one_pending_output_and_then_the_terminal_error():
    async def run():
        engine = FakeEngine()
        stream = RequestStream("caller-id", "key-1", asyncio.get_running_loop(), engine, DELTA)
        for i in range(10):
            assert stream.put(output(delta(0, str(i), [i])))
        stream.put(RequestFailedError("the engine failed this request: RuntimeError"))
        stream.put(EngineDeadError("later"))  # the first terminal error is the one raised
        await asyncio.sleep(0)  # the loop thread's wake-up runs
        first = await stream.__anext__()
        with pytest.raises(RequestFailedError, match="RuntimeError"):
            await stream.__anext__()
        stream.abort()  # finished: nothing to abort
        return first, engine.aborted

    first, aborted = asyncio.run(run())
    assert first.outputs[0].text == "0123456789" and first.outputs[0].token_ids == list(range(10))
    assert aborted == []


def test_stream_abort_aborts_its_own_key_only():
    async def run():
        engine = FakeEngine()
        stream = RequestStream("x", "key-7", asyncio.get_running_loop(), engine, CUMULATIVE)
        stream.abort()
        stream.abort()
        return engine.aborted

    assert asyncio.run(run()) == ["key-7"]
