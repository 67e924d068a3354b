"""AsyncEngine: the step loop on its thread, streams, cancellation, a failing step, backpressure, idling."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from tests.conftest import assert_idle
from paged_runtime import SamplingParams
from paged_runtime.config import EngineConfig
from paged_runtime.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from paged_runtime.engine.client import EngineClient
from paged_runtime.sampling_params import ParameterError

from .conftest import fail_on_step

PROMPT = "The quick brown fox jumps over"


def make_engine(model_dir, **kwargs) -> AsyncEngine:
    engine_kwargs = {"dtype": "float32", "debug_checks": True, "max_model_len": 256, "kv_cache_memory": 8 * 2**20}
    async_kwargs = {k: kwargs.pop(k) for k in ("max_waiting_requests", "stat_loggers") if k in kwargs}
    return AsyncEngine.from_config(EngineConfig(model=str(model_dir), **engine_kwargs, **kwargs), **async_kwargs)


@pytest.fixture
def engine(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


async def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Waits (bounded) until the loop has no request and the scheduler none either."""
    deadline = time.monotonic() + timeout
    while engine.num_unfinished_requests or engine.stats.num_running or engine.stats.num_waiting:
        assert time.monotonic() < deadline, "engine did not go idle"
        await asyncio.sleep(0.01)


def greedy(max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def record_steps(engine: AsyncEngine) -> list[list[int]]:
    """Per engine step, the new token count of each sequence that moved. (A stream may merge the outputs
    of several steps when its reader falls behind, so per-step facts are taken at the engine.)"""
    real_step, steps = engine.engine.step, []

    def step():
        outputs = real_step()
        steps.append([len(c.delta_token_ids) for out in outputs for c in out.outputs])
        return outputs

    engine.engine.step = step
    return steps


def test_generate_streams_increments_and_matches_offline(engine, tiny_llm):
    steps = record_steps(engine)

    async def run():
        return [out async for out in engine.generate(PROMPT, greedy(), request_id="a")]

    outputs = asyncio.run(run())
    expected = tiny_llm.generate([PROMPT], greedy(), use_tqdm=False)[0].outputs[0]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert "".join(o.outputs[0].delta_text for o in outputs) == expected.text
    assert outputs[-1].outputs[0].token_ids == expected.token_ids
    assert [t for o in outputs for t in o.outputs[0].delta_token_ids] == expected.token_ids
    assert all(o.outputs[0].delta_token_ids for o in outputs)
    assert steps == [[1]] * 24  # one output per step, one token each


def test_concurrent_requests_from_one_loop(engine, tiny_llm):
    prompts = [f"{PROMPT} {i}" for i in range(6)]

    async def one(i: int) -> str:
        async for out in engine.generate(prompts[i], greedy(12), request_id=f"r{i}"):
            pass
        return out.outputs[0].text

    async def run():
        return await asyncio.gather(*(one(i) for i in range(6)))

    texts = asyncio.run(run())
    assert texts == [o.outputs[0].text for o in tiny_llm.generate(prompts, greedy(12), use_tqdm=False)]


def test_breaking_out_aborts_and_frees_blocks(engine):
    async def run():
        async for out in engine.generate(PROMPT, greedy(200), request_id="leaver"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        await wait_idle(engine)

    asyncio.run(run())
    assert_idle(engine)  # every block back in the free queue


def test_cancelled_consumer_aborts(engine):
    async def consume(started: asyncio.Event):
        async for _ in engine.generate(PROMPT, greedy(200), request_id="cancelled"):
            started.set()

    async def run():
        started = asyncio.Event()
        task = asyncio.create_task(consume(started))
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)

    asyncio.run(run())
    assert_idle(engine)


def test_explicit_abort_ends_stream_with_abort(engine):
    async def run():
        stream = engine.add_request("x", PROMPT, greedy(200))
        first = await stream.__anext__()
        await engine.abort("x")
        rest = [out async for out in stream]
        await engine.abort("unknown-id")  # ignored
        await wait_idle(engine)
        return first, rest

    first, rest = asyncio.run(run())
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert_idle(engine)


def test_invalid_request_raises_before_queueing(engine):
    async def run():
        with pytest.raises(ParameterError, match="max_model_len is 256") as info:
            engine.add_request("long", [5] * 300, greedy())
        assert info.value.param == "prompt"
        with pytest.raises(ParameterError, match="empty"):
            engine.add_request("empty", [], greedy())
        with pytest.raises(ParameterError, match="max_num_seqs") as info:
            engine.add_request("wide", PROMPT, SamplingParams(n=engine.max_num_seqs + 1))
        assert info.value.param == "n"
        stream = engine.add_request("dup", PROMPT, greedy(50))
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup", PROMPT, greedy())
        stream.abort()
        await wait_idle(engine)

    asyncio.run(run())


def test_failing_step_fails_requests_and_marks_unhealthy(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    fail_on_step(engine, 3, "device fell over")

    async def run():
        streams = [engine.add_request(f"r{i}", PROMPT, greedy(100)) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineDeadError, match="device fell over"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            engine.add_request("late", PROMPT, greedy())

    try:
        asyncio.run(asyncio.wait_for(run(), 30))  # never hangs
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()


def test_waiting_queue_bound_raises_overloaded(tiny_llama_dir):
    """With the engine held inside its second step, queued requests pile up: the limit is exact."""
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_waiting_requests=2)
    real_step, release, in_step = engine.engine.step, threading.Event(), threading.Event()
    calls = 0

    def held_step():
        nonlocal calls
        calls += 1
        if calls == 2:  # the first step has scheduled "running": nothing waits now
            in_step.set()
            assert release.wait(30)
        return real_step()

    engine.engine.step = held_step

    async def run():
        running = engine.add_request("running", PROMPT, greedy(8))
        assert await asyncio.to_thread(in_step.wait, 30)
        queued = [engine.add_request(f"q{i}", PROMPT, greedy(8)) for i in range(2)]
        with pytest.raises(EngineOverloadedError) as info:
            engine.add_request("refused", PROMPT, greedy(8))
        assert info.value.retry_after >= 1
        release.set()
        finals = []
        for stream in [running, *queued]:  # admitted requests are unaffected
            async for out in stream:
                pass
            finals.append(out.outputs[0])
        return finals

    try:
        finals = asyncio.run(asyncio.wait_for(run(), 60))
        assert [len(c.token_ids) for c in finals] == [8, 8, 8]
        assert [c.finish_reason for c in finals] == ["length"] * 3
    finally:
        release.set()
        engine.shutdown()


def test_idle_loop_sleeps(tiny_llama_dir):
    """After the work is done the loop makes no more passes (it waits on its condition, no polling)."""

    from paged_runtime.metrics import StatLogger

    class Counter(StatLogger):
        def __init__(self):
            self.passes = 0

        def record(self, stats):
            self.passes += 1

        def close(self):
            pass

    counter = Counter()
    engine = make_engine(tiny_llama_dir, stat_loggers=[counter])

    async def run():
        async for _ in engine.generate(PROMPT, greedy(4)):
            pass
        await wait_idle(engine)

    try:
        asyncio.run(run())
        settled = counter.passes
        time.sleep(0.3)  # a busy loop would make thousands of passes here
        assert counter.passes == settled
        assert 4 <= settled <= 8
    finally:
        engine.shutdown()


def test_shutdown_fails_inflight_requests(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)

    async def run():
        stream = engine.add_request("r", PROMPT, greedy(200))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(run(), 30))
    assert not engine.is_healthy


def test_speculative_decoding_streams_several_tokens_a_step_and_counts_them(tiny_llama_dir, tiny_llm):
    """A draft model equal to the target accepts every draft: the stream gets k + 1 tokens a step,
    the text equals plain decoding, and the loggers see every draft and acceptance exactly once."""
    from paged_runtime.metrics import StatLogger

    class Recorder(StatLogger):
        def __init__(self):
            self.drafts = self.draft_tokens = self.accepted = 0
            self.per_position = [0, 0, 0]

        def record(self, stats):
            self.drafts += stats.num_spec_drafts
            self.draft_tokens += stats.num_spec_draft_tokens
            self.accepted += stats.num_spec_accepted_tokens
            self.per_position = [a + b for a, b in zip(self.per_position, stats.spec_accepted_per_position)]

        def close(self):
            pass

    recorder = Recorder()
    engine = make_engine(tiny_llama_dir, stat_loggers=[recorder],
                         speculative_config={"method": "draft_model", "model": str(tiny_llama_dir),
                                             "num_speculative_tokens": 3})
    steps = record_steps(engine)

    async def run():
        return [out async for out in engine.generate(PROMPT, greedy(max_tokens=21), request_id="s")]

    try:
        outputs = asyncio.run(run())
        asyncio.run(wait_idle(engine))
        spec = engine.engine.stats().spec
    finally:
        engine.shutdown()
    expected = tiny_llm.generate([PROMPT], greedy(max_tokens=21), use_tqdm=False)[0].outputs[0]
    assert "".join(o.outputs[0].delta_text for o in outputs) == expected.text
    # The first token comes from the prefill; then 5 verifications of 3 drafts give 4 tokens each.
    assert [t for o in outputs for t in o.outputs[0].delta_token_ids] == expected.token_ids
    assert steps == [[1], [4], [4], [4], [4], [4]]
    assert (recorder.drafts, recorder.draft_tokens, recorder.accepted, recorder.per_position) == (
        spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.accepted_per_position) == (
        5, 15, 15, [5, 5, 5])


def test_declared_client_api(engine, tiny_llama_dir):
    """What the routes and adapters use: the model's facts, caller-side processing, a prefix-cache reset."""
    assert isinstance(engine, EngineClient)
    assert engine.model_root == str(tiny_llama_dir) and engine.max_model_len == 256
    assert engine.process([5, 6, 7], greedy(10)).max_tokens == 10
    with pytest.raises(ParameterError) as info:
        engine.process([engine.vocab_size], greedy())
    assert info.value.param == "prompt" and info.value.code is None
    prompt = list(range(5, 45))  # two full blocks of 16 tokens, cached once finished

    async def run_once() -> int:
        async for _ in engine.generate(prompt, greedy(2)):
            pass
        await wait_idle(engine)
        return engine.stats.num_prefix_hits

    async def scenario() -> list[int]:
        hits = [await run_once(), await run_once()]
        engine.reset_prefix_cache()
        return hits + [await run_once()]

    first, second, after_reset = asyncio.run(scenario())
    assert first == 0 and second == 32 and after_reset == second


# ---- hardening: one bad request, whatever kills the loop, slow readers, ids and aborts ----------------
def test_a_request_the_engine_fails_ends_only_its_own_stream(engine, tiny_llm, monkeypatch):
    """Its detokenizer raises: that stream ends with RequestFailedError, the others finish exactly."""
    from paged_runtime.engine.client import RequestFailedError
    from paged_runtime.engine.detokenizer import IncrementalDetokenizer

    bad = greedy(50)
    real_add_tokens = IncrementalDetokenizer.add_tokens

    def add_tokens(self, token_ids):
        if self.params is bad and self.text:
            raise RuntimeError("undecodable")
        return real_add_tokens(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", add_tokens)
    prompts = [f"{PROMPT} {i}" for i in range(3)]

    async def text_of(stream) -> str:
        async for out in stream:
            pass
        return out.outputs[0].text

    async def run():
        failing = engine.add_request("bad", PROMPT, bad)
        others = [engine.add_request(f"ok{i}", p, greedy(12)) for i, p in enumerate(prompts)]
        with pytest.raises(RequestFailedError, match="^the engine failed this request: RuntimeError$"):
            async for _ in failing:
                pass
        texts = await asyncio.gather(*(text_of(s) for s in others))
        later = await text_of(engine.add_request("later", prompts[0], greedy(12)))
        await wait_idle(engine)
        return texts, later

    texts, later = asyncio.run(asyncio.wait_for(run(), 60))
    expected = [o.outputs[0].text for o in tiny_llm.generate(prompts, greedy(12), use_tqdm=False)]
    assert texts == expected and later == expected[0]
    assert engine.is_healthy
    engine.check_health()
    assert_idle(engine)


def test_a_bug_while_delivering_an_output_fails_that_stream_and_nothing_else(engine, tiny_llm, monkeypatch):
    """Delivery raises for one request (a bug in accounting or merging): its consumer gets an error instead
    of waiting forever, its blocks come back, and the loop goes on serving."""
    from paged_runtime.engine.client import RequestFailedError

    real_account = engine._account

    def account(tracked, output, stats):
        if tracked.stream.request_id == "bad":
            raise RuntimeError("accounting bug")
        return real_account(tracked, output, stats)

    monkeypatch.setattr(engine, "_account", account)

    async def run():
        failing = engine.add_request("bad", PROMPT, greedy(40))
        with pytest.raises(RequestFailedError, match="while delivering"):
            async for _ in failing:
                pass
        async for out in engine.add_request("ok", PROMPT, greedy(12)):
            pass
        await wait_idle(engine)
        return out.outputs[0].text

    text = asyncio.run(asyncio.wait_for(run(), 60))
    assert text == tiny_llm.generate([PROMPT], greedy(12), use_tqdm=False)[0].outputs[0].text
    assert engine.is_healthy
    assert_idle(engine)


class Fatal(BaseException):
    """Not an Exception: what a bare ``except Exception`` lets through (like KeyboardInterrupt)."""


def test_whatever_kills_the_loop_fails_every_client_and_refuses_new_ones(tiny_llama_dir, caplog):
    engine = make_engine(tiny_llama_dir)
    real_step, calls = engine.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise Fatal("not an Exception")
        return real_step()

    engine.engine.step = step

    async def run():
        streams = [engine.add_request(f"r{i}", PROMPT, greedy(100)) for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineDeadError, match="Fatal"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            engine.add_request("late", PROMPT, greedy())

    try:
        with caplog.at_level(logging.ERROR):
            asyncio.run(asyncio.wait_for(run(), 30))  # never hangs
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.check_health()
        assert "the step loop died" in caplog.text
    finally:
        engine.shutdown()


def test_a_reader_that_does_not_read_holds_one_coalesced_output(engine, tiny_llm):
    async def run():
        stream = engine.add_request("slow", PROMPT, greedy(24))
        await wait_idle(engine)  # all 24 steps ran while nobody read
        return [out async for out in stream]

    outputs = asyncio.run(asyncio.wait_for(run(), 60))
    expected = tiny_llm.generate([PROMPT], greedy(24), use_tqdm=False)[0].outputs[0]
    assert len(outputs) == 1 and outputs[0].finished
    c = outputs[0].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == (expected.text, expected.token_ids, "length")
    assert (c.delta_text, c.delta_token_ids) == (expected.text, expected.token_ids)  # a streamer loses nothing


def test_a_late_abort_never_reaches_a_new_request_with_the_same_id(engine, tiny_llm):
    """The engine delivered "x"'s final output; before its consumer reads it, a new "x" arrives and the old
    consumer leaves (abort). The loop takes both in one pass (the test holds its lock): only the old one is hit."""
    async def run():
        old = engine.add_request("x", PROMPT, greedy(2))
        await wait_idle(engine)  # finished and delivered, not read
        with engine._cond:  # the loop takes the add and the abort together
            new = engine.add_request("x", PROMPT, greedy(12))
            old.abort()
        outputs = [out async for out in new]
        await wait_idle(engine)
        return outputs

    outputs = asyncio.run(asyncio.wait_for(run(), 60))
    expected = tiny_llm.generate([PROMPT], greedy(12), use_tqdm=False)[0].outputs[0]
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert outputs[-1].outputs[0].token_ids == expected.token_ids
    assert {out.request_id for out in outputs} == {"x"}  # the caller's id, not the engine's key
    assert_idle(engine)


def test_abort_by_caller_id_reaches_the_live_request(engine):
    async def run():
        done = engine.add_request("y", PROMPT, greedy(2))
        async for _ in done:
            pass
        live = engine.add_request("y", PROMPT, greedy(200))
        await live.__anext__()
        await engine.abort("y")
        rest = [out async for out in live]
        await wait_idle(engine)
        return rest

    rest = asyncio.run(asyncio.wait_for(run(), 60))
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert rest[-1].request_id == "y"
    assert_idle(engine)
