"""A step that raises fails only the requests it concerns; the engine keeps serving everyone else exactly.

Faults are injected into one marked request (its ``SamplingParams`` object): in the runner's preparation
of that request (only it fails), in the forward pass of a batch holding it (the whole batch fails), and in
its detokenizer (only it fails). Every other request must give the exact tokens of a fault-free run, and
every KV block must come back. A fault that leaves the state untrusted still raises out of ``step``.
Everything holds with asynchronous scheduling too, where the step queued behind a failed one is rolled back.
"""
from __future__ import annotations

import logging

import pytest

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams
from paged_runtime.engine.detokenizer import IncrementalDetokenizer

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": list(range(100, 140)), "c": [42] * 20}
BAD_PROMPT = list(range(300, 330))
ERROR = "the engine failed this request: RuntimeError"


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_llama_dir, request):
    return make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=8 * 2**20, async_scheduling=request.param)


@pytest.fixture(scope="module")
def reference(llm):
    """Fault-free token ids of every prompt in PROMPTS."""
    finals = run(llm.engine, {rid: (p, greedy()) for rid, p in PROMPTS.items()})
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


def run(engine, requests: dict) -> dict:
    """Adds ``{id: (prompt, params)}`` and steps until the engine is idle; the finished outputs by id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals, "an output after the finished one"
            if out.finished:
                finals[out.request_id] = out
    return finals


def assert_failed(out, n: int = 1) -> None:
    assert out.finished and out.error == ERROR
    assert [c.finish_reason for c in out.outputs] == ["error"] * n


def test_runner_preparation_fault_fails_only_that_request(llm, reference, monkeypatch):
    runner, bad = llm.engine.core.runner, greedy()
    real_add = runner.states.add

    def add(new):
        if new.params is bad:
            raise RuntimeError("cannot seed this request")
        return real_add(new)

    monkeypatch.setattr(runner.states, "add", add)
    finals = run(llm.engine, {"bad": (BAD_PROMPT, bad), **{rid: (p, greedy()) for rid, p in PROMPTS.items()}})
    assert_failed(finals.pop("bad"))
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == reference
    assert "bad" not in runner.states.requests
    assert_idle(llm)


def test_forward_fault_fails_its_batch_and_later_requests_are_exact(llm, reference, monkeypatch):
    runner, bad = llm.engine.core.runner, greedy()
    real_run, calls = runner._run, []

    def faulty_run(items):
        if any(runner.states[s.request_id].params is bad for s in items) and not calls:
            calls.append(1)
            raise RuntimeError("device fell over")
        return real_run(items)

    monkeypatch.setattr(runner, "_run", faulty_run)
    finals = run(llm.engine, {"bad": (BAD_PROMPT, bad), "a": (PROMPTS["a"], greedy())})
    assert calls == [1]
    assert_failed(finals["bad"])
    assert_failed(finals["a"])  # it was in the failed batch
    assert not runner.states.requests, "the failed batch's rows are dropped at once"
    assert_idle(llm)
    later = run(llm.engine, {rid: (p, greedy()) for rid, p in PROMPTS.items()})
    assert {rid: out.outputs[0].token_ids for rid, out in later.items()} == reference
    assert_idle(llm)


@pytest.mark.parametrize("n", [1, 3])
def test_detokenizer_fault_fails_only_that_request(llm, reference, monkeypatch, n):
    bad = SamplingParams(n=n, max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    real_add_tokens, calls = IncrementalDetokenizer.add_tokens, []

    def add_tokens(self, token_ids):
        if self.params is bad:
            calls.append(self)
            if len(calls) == 3:  # a third token of one of its sequences
                raise RuntimeError("undecodable")
        return real_add_tokens(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", add_tokens)
    finals = run(llm.engine, {"bad": (BAD_PROMPT, bad), **{rid: (p, greedy()) for rid, p in PROMPTS.items()}})
    assert_failed(finals.pop("bad"), n)
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == reference
    assert_idle(llm)


def step_until_output(engine) -> list:
    """The first step's outputs (with asynchronous scheduling, the second call brings the first step's)."""
    for _ in range(2):
        outputs = engine.step()
        if outputs:
            return outputs
    return []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_untrusted_state_raises_and_says_so(tiny_llama_dir, caplog, async_scheduling):
    """A fault that also breaks the block accounting cannot be contained: ``step`` raises."""
    llm = make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=8 * 2**20, async_scheduling=async_scheduling)
    core = llm.engine.core
    real_run = core.runner._run

    def corrupting_run(items):
        core.kv_cache.pool.blocks[-1].ref_count += 1  # a leaked reference nobody holds
        raise RuntimeError("device fell over")

    core.runner._run = corrupting_run
    llm.engine.add_request("a", PROMPTS["a"], greedy())
    with caplog.at_level(logging.ERROR), pytest.raises(AssertionError):
        step_until_output(llm.engine)
    assert "cannot be trusted" in caplog.text
    core.runner._run = real_run


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_forward_passes_failing_in_a_row_mean_the_engine_is_broken(tiny_llama_dir, caplog, async_scheduling):
    """Not one bad batch but every batch: after the third failed step in a row, ``step`` raises."""
    llm = make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=8 * 2**20, async_scheduling=async_scheduling)

    def broken_run(items):
        raise RuntimeError("device fell over")

    llm.engine.core.runner._run = broken_run
    for i in range(2):
        llm.engine.add_request(f"r{i}", PROMPTS["a"], greedy())
        [out] = step_until_output(llm.engine)
        assert_failed(out)
    llm.engine.add_request("r2", PROMPTS["a"], greedy())
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="device fell over"):
        step_until_output(llm.engine)
    assert "cannot be trusted" in caplog.text


def test_a_fault_while_making_the_final_output_still_ends_the_request(llm, reference, monkeypatch):
    """``_make_output`` raises after it let the finished request's state go: the client still gets its error."""
    engine, bad = llm.engine, greedy(4)
    real_make_output = engine._make_output

    def make_output(group_id, moved):
        state = engine.states[group_id]
        output = real_make_output(group_id, moved)
        if state.params is bad and output.finished:
            raise RuntimeError("cannot build the output")
        return output

    monkeypatch.setattr(engine, "_make_output", make_output)
    finals = run(engine, {"bad": (BAD_PROMPT, bad), **{rid: (p, greedy()) for rid, p in PROMPTS.items()}})
    assert_failed(finals.pop("bad"))
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == reference
    assert "bad" not in engine.states
    assert_idle(llm)


def test_the_step_queued_behind_a_failed_one_is_rolled_back(tiny_llama_dir):
    """Asynchronous scheduling: step N + 1 (which admits "a") is launched before step N (holding only "bad")
    fails. It never runs; "a" is told to the runner again and finishes exactly."""
    llm = make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=8 * 2**20, async_scheduling=True)
    engine, runner, bad = llm.engine, llm.engine.core.runner, greedy()
    expected = run(engine, {"a": (PROMPTS["a"], greedy())})["a"].outputs[0].token_ids
    real_run, steps = runner._run, []

    def faulty_run(items):
        steps.append(len(items))
        if any(runner.states[s.request_id].params is bad for s in items):
            raise RuntimeError("device fell over")
        return real_run(items)

    runner._run = faulty_run
    engine.add_request("bad", BAD_PROMPT, bad)
    assert engine.step() == []  # step N launched
    engine.add_request("a", PROMPTS["a"], greedy())
    [out] = engine.step()  # step N + 1 (bad's next token, and "a") launched; step N fails
    assert out.request_id == "bad"
    assert_failed(out)
    assert steps == [1], "the queued step must not reach the model"
    finals = run(engine, {})
    assert finals["a"].outputs[0].token_ids == expected
    runner._run = real_run
    assert_idle(llm)
