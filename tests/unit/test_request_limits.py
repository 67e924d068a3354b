"""Limits on the engine's request path: values that once killed or stalled the engine, checked at the edge
(Processor) and again in ``LLMEngine.add_request``; internal ids; stop-string caps; output kinds."""
from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import assert_idle, make_llm
from paged_runtime.engine.detokenizer import IncrementalDetokenizer
from paged_runtime.engine.processor import ProcessedPrompt
from paged_runtime.outputs import RequestOutput
from paged_runtime.request import RequestStatus
from paged_runtime.sampling_params import ParameterError, RequestOutputKind, SamplingParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory=2 * 2**20, max_num_seqs=4,
                    max_stop_strings=3, max_stop_string_length=8)


def run(engine, max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    """Every output of every request, by caller id, until the engine is idle (a stall fails, not hangs)."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def greedy(max_tokens: int = 6, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


# ---- values that overflowed or went NaN inside a step ----------------------------------------------
def test_top_k_beyond_int64_means_no_filter(llm):
    [plain, huge] = llm.generate(["a b c", "a b c"], [SamplingParams(max_tokens=6, seed=5),
                                                      SamplingParams(max_tokens=6, seed=5, top_k=2**70)],
                                 use_tqdm=False)
    assert huge.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_idle(llm)


def test_a_seed_near_2_64_with_siblings_runs(llm):
    [out] = llm.generate(["a b c"], SamplingParams(n=3, max_tokens=4, seed=2**64 - 1), use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [4, 4, 4]
    [again] = llm.generate(["a b c"], SamplingParams(n=3, max_tokens=4, seed=2**64 - 1), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_idle(llm)


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_min_tokens_beyond_the_room_left_is_refused(llm, max_tokens):
    prompt = list(range(10, 10 + MAX_MODEL_LEN - 10))  # room for 10 tokens
    with pytest.raises(ParameterError) as info:
        llm.engine.process(prompt, SamplingParams(max_tokens=max_tokens, min_tokens=11))
    assert info.value.param == "min_tokens"
    assert llm.engine.process(prompt, SamplingParams(max_tokens=max_tokens, min_tokens=10)).max_tokens == 10


def test_add_request_rechecks_a_processed_prompt(llm):
    engine, vocab = llm.engine, llm.engine.vocab_size
    bad = [(ProcessedPrompt(None, [5] * MAX_MODEL_LEN, 1), greedy(), "prompt"),
           (ProcessedPrompt(None, [5, vocab], 4), greedy(), "prompt"),
           (ProcessedPrompt(None, [5, -1], 4), greedy(), "prompt"),
           (ProcessedPrompt(None, [5, 6], MAX_MODEL_LEN), greedy(), "max_tokens"),
           (ProcessedPrompt(None, [5, 6], 0), greedy(), "max_tokens"),
           (ProcessedPrompt(None, [5, 6], 4), greedy(None, min_tokens=MAX_MODEL_LEN - 1), "min_tokens"),
           (ProcessedPrompt(None, [5, 6], 4), greedy(stop=["a", "b", "c", "d"]), "stop"),
           (ProcessedPrompt(None, [5, 6], 4), greedy(logit_bias={vocab: 1.0}), "logit_bias")]
    for processed, params, param in bad:
        with pytest.raises(ParameterError) as info:
            engine.add_request("checked", processed, params)
        assert info.value.param == param, processed
    assert not engine.has_unfinished_requests()
    engine.add_request("checked", ProcessedPrompt(None, [5, 6], 4), greedy())  # the id was never taken
    assert run(engine)["checked"][-1].finished
    assert_idle(llm)


# ---- stop strings ------------------------------------------------------------------------------
def test_stop_string_caps_come_from_the_config(llm):
    for stop, what in ((["a", "b", "c", "d"], "at most 3"), (["123456789"], "at most 8")):
        with pytest.raises(ParameterError) as info:
            llm.engine.process("hello", SamplingParams(stop=stop))
        assert info.value.param == "stop" and what in str(info.value)
    llm.engine.process("hello", SamplingParams(stop=["a", "b", "12345678"]))


def test_the_earliest_stop_string_in_the_new_text_wins(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(" xx yy zz", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["zz", "yy"]))
    assert detok.add_tokens(ids) == "yy" and detok.text == " xx "
    kept = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["zz", "yy"], include_stop_str_in_output=True))
    assert kept.add_tokens(ids) == "yy" and kept.text == " xx yy"


# ---- ids ----------------------------------------------------------------------------------------
def test_a_caller_id_equal_to_a_childs_internal_id_is_just_another_request(llm):
    engine = llm.engine
    solo = run_one(engine, "solo", "a b c", greedy())
    engine.add_request("x", "a b c", greedy(n=2))
    engine.add_request("x\x1f1", "a b c", greedy())
    outputs = run(engine)
    assert [c.token_ids for c in outputs["x"][-1].outputs] == [solo, solo]
    assert [c.token_ids for c in outputs["x\x1f1"][-1].outputs] == [solo]
    with pytest.raises(ValueError):
        engine.add_request("y", "a b c", greedy())
        engine.add_request("y", "a b c", greedy())
    engine.abort_request(["y"])
    assert not engine.has_unfinished_requests()
    assert_idle(llm)


def run_one(engine, request_id: str, prompt, params: SamplingParams) -> list[int]:
    engine.add_request(request_id, prompt, params)
    return run(engine)[request_id][-1].outputs[0].token_ids


# ---- output kinds ------------------------------------------------------------------------------
def test_delta_outputs_add_up_to_the_cumulative_ones(llm):
    engine, prompt = llm.engine, "one two three four five"
    text = llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # ends the sequences mid-way, with a stop_reason
    outputs = {}
    for kind in RequestOutputKind:  # one at a time: the same batches, so the same logprobs
        engine.add_request(kind.name, prompt, dataclasses.replace(greedy(12, n=2, logprobs=2, stop=[stop]),
                                                                  output_kind=kind))
        outputs |= run(engine)
    final = outputs["CUMULATIVE"][-1]
    assert final.outputs[0].stop_reason == stop and len(final.outputs[0].token_ids) > 1
    assert len(outputs["FINAL_ONLY"]) == 1 and outputs["FINAL_ONLY"][0].finished
    whole = lambda c: (c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
    assert [whole(c) for c in outputs["FINAL_ONLY"][0].outputs] == [whole(c) for c in final.outputs]
    deltas = outputs["DELTA"]
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    for index, whole in enumerate(final.outputs):
        mine = [c for o in deltas for c in o.outputs if c.index == index]
        assert "".join(c.text for c in mine) == whole.text
        assert [t for c in mine for t in c.token_ids] == whole.token_ids
        assert [p for c in mine for p in c.logprobs] == whole.logprobs
        assert all(c.text == c.delta_text and c.token_ids == c.delta_token_ids for c in mine)
        assert max(len(c.token_ids) for c in mine) <= 1  # one step's worth, never the whole sequence
        assert (mine[-1].finish_reason, mine[-1].stop_reason) == (whole.finish_reason, whole.stop_reason)
    assert_idle(llm)


def test_generate_asks_for_final_outputs_without_touching_the_callers_params(llm):
    params = greedy(5)
    calls = []
    original = llm.engine.add_request
    llm.engine.add_request = lambda *args, **kw: calls.append(args[2].output_kind) or original(*args, **kw)
    try:
        [out] = llm.generate(["a b c"], params, use_tqdm=False)
    finally:
        del llm.engine.add_request
    assert calls == [RequestOutputKind.FINAL_ONLY] and params.output_kind == RequestOutputKind.CUMULATIVE
    assert len(out.outputs[0].token_ids) == 5


# ---- live max_num_seqs ---------------------------------------------------------------------------
def test_lowering_max_num_seqs_below_a_queued_group_does_not_strand_it(llm):
    engine = llm.engine
    engine.add_request("group", "a b c", greedy(4, n=3))
    engine.add_request("after", "a b c", greedy(4))
    assert engine.reconfigure(max_num_seqs=1)
    try:
        outputs = run(engine)
    finally:
        engine.reconfigure(max_num_seqs=4)
    assert [len(c.token_ids) for c in outputs["group"][-1].outputs] == [4, 4, 4]
    assert outputs["after"][-1].finished
    assert_idle(llm)


def test_lowering_max_num_seqs_counts_the_forks_a_prefilling_group_will_add(tiny_llama_dir):
    """A group of 4 still in chunked prefill holds 4 seats: lowering the limit to 2 beside another request
    must not let 5 sequences of 2 groups run under a limit of 2 (the invariant check used to fail)."""
    chunked = make_llm(tiny_llama_dir, max_model_len=64, kv_cache_memory=2**20, max_num_seqs=8,
                       max_num_batched_tokens=8)
    engine, scheduler = chunked.engine, chunked.engine.core.scheduler
    engine.add_request("other", "a b c", greedy(6))
    engine.add_request("group", list(range(10, 40)), greedy(4, n=4))
    engine.step()
    assert scheduler.num_running == 2 and scheduler.num_seats == 5  # the group is prefilling, 3 forks pending
    assert not engine.reconfigure(max_num_seqs=2)  # not yet: the limit follows the seats down
    assert scheduler.max_num_seqs == 5
    outputs = run(engine)
    assert [len(c.token_ids) for c in outputs["group"][-1].outputs] == [4, 4, 4, 4]
    assert outputs["other"][-1].finished
    assert engine.reconfigure(max_num_seqs=2) and scheduler.max_num_seqs == 2
    assert_idle(chunked)


# ---- a request that outgrows the cache ----------------------------------------------------------
def test_a_request_that_outgrows_the_cache_fails_alone_with_an_error(tiny_llama_dir):
    small = make_llm(tiny_llama_dir, max_model_len=64, max_num_seqs=1, block_size=16,
                     kv_cache_memory=2**20)  # capped at 4 blocks: exactly one 64-token request
    engine, scheduler = small.engine, small.engine.core.scheduler
    assert small.engine.core.num_blocks == 4
    engine.add_request("grower", "a b c", SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))
    engine.add_request("after", "a b c", greedy(3))
    grower = next(iter(scheduler.requests.values()))  # added first
    grower.max_tokens = 10**6  # as if nothing had capped it; the scheduler's own guard lifted too
    scheduler.max_model_len = None
    outputs = run(engine)
    failed = outputs["grower"][-1]
    assert failed.finished and "KV cache" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"] and len(failed.outputs[0].token_ids) == 65 - len(failed.prompt_token_ids)
    assert outputs["after"][-1].outputs[0].finish_reason == "length" and outputs["after"][-1].error is None
    assert grower.status == RequestStatus.FINISHED_ERROR
    assert_idle(small)


def test_a_text_longer_than_any_prompt_that_fits_is_refused_untokenized(llm, monkeypatch):
    processor = llm.engine._processor
    limit = processor.max_prompt_chars
    monkeypatch.setattr(processor, "tokenizer", None)  # tokenizing would raise AttributeError
    with pytest.raises(ParameterError, match=f"{limit} characters at most") as refused:
        llm.engine.process("a" * (limit + 1), greedy())
    assert refused.value.param == "prompt"
