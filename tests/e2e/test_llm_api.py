"""The offline ``LLM`` API: prompts, stopping, text, seeds and bad input."""
from __future__ import annotations

import shutil

import pytest

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=4 * 2**20)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return make_llm(smollm2_dir, max_model_len=512, kv_cache_memory=64 * 2**20)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def test_outputs_in_input_order_for_every_prompt_form(tiny):
    ids = tiny.get_tokenizer().encode("hello world")
    outs = tiny.generate(["hello world", {"prompt_token_ids": ids}, {"prompt": "hello world"}, ids],
                         greedy(5), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].prompt == "hello world" and outs[1].prompt is None
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 5 for o in outs)
    assert_idle(tiny)


def test_stop_token_ids_end_generation_without_text(tiny):
    [free_run] = tiny.generate(["a b c"], greedy(12), use_tqdm=False)
    tokens = free_run.outputs[0].token_ids
    stop_id = tokens[4]
    [stopped] = tiny.generate(["a b c"], greedy(12, stop_token_ids=[stop_id]), use_tqdm=False)
    first = tokens.index(stop_id)
    assert stopped.outputs[0].token_ids == tokens[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id
    tokenizer = tiny.get_tokenizer()
    assert stopped.outputs[0].text == tokenizer.decode(tokens[:first], skip_special_tokens=True)


def test_stop_strings_are_cut_from_the_text(smol):
    prompt = "Count: 1, 2, 3, 4, 5,"
    [free_run] = smol.generate([prompt], greedy(20), use_tqdm=False)
    text = free_run.outputs[0].text
    assert "8" in text, text
    [stopped] = smol.generate([prompt], greedy(20, stop=["8"]), use_tqdm=False)
    assert stopped.outputs[0].text == text[:text.index("8")]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == "8"
    [kept] = smol.generate([prompt], greedy(20, stop=["8"], include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[:text.index("8") + 1]
    assert_idle(smol)


def test_eos_stops_unless_ignored(smol):
    messages = [{"role": "user", "content": "Say hi."}]
    [out] = smol.chat(messages, greedy(64), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in out.outputs[0].text and out.outputs[0].text
    [longer] = smol.chat(messages, greedy(len(out.outputs[0].token_ids) + 3, ignore_eos=True), use_tqdm=False)
    assert longer.outputs[0].finish_reason == "length"
    assert longer.outputs[0].token_ids[:len(out.outputs[0].token_ids)] == out.outputs[0].token_ids


def test_chat_uses_the_tokenizer_template(smol):
    tokenizer = smol.get_tokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    [out] = smol.chat(messages, greedy(2), use_tqdm=False)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(out.prompt_token_ids) == expected
    assert expected.startswith("<|im_start|>system\n") and expected.endswith("<|im_start|>assistant\n")


def test_multibyte_characters_stream_whole(smol):
    tokenizer = smol.get_tokenizer()
    token_ids = tokenizer.encode("日本語のテキスト 🙂 ok")
    from paged_runtime.engine.detokenizer import IncrementalDetokenizer
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    pieces = []
    for token_id in token_ids:
        detok.add_tokens([token_id])
        pieces.append(detok.take_delta(finished=False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "日本語のテキスト 🙂 ok"


def test_streaming_holds_back_a_possible_stop_string(smol):
    tokenizer = smol.get_tokenizer()
    from paged_runtime.engine.detokenizer import IncrementalDetokenizer
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=["END"]))
    pieces = []
    stop = None
    for token_id in tokenizer.encode("hello EN then END more"):
        stop = stop or detok.add_tokens([token_id])
        pieces.append(detok.take_delta(finished=stop is not None))
        if stop:
            break
    assert stop == "END" and "".join(pieces) == "hello EN then "


def test_seeded_sampling_ignores_batch_makeup(tiny):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    [alone] = tiny.generate(["the quick brown fox"], seeded, use_tqdm=False)
    crowd = ["a", "the quick brown fox", "b c d", "lorem ipsum"]
    params = [SamplingParams(max_tokens=9, temperature=0.8), seeded, greedy(20),
              SamplingParams(max_tokens=16, temperature=1.0, seed=7)]
    outs = tiny.generate(crowd, params, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = tiny.generate(["the quick brown fox"], SamplingParams(max_tokens=16, temperature=1.0, top_k=50,
                                                                       top_p=0.9, seed=99), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids
    assert_idle(tiny)


def test_top_k_one_is_greedy(tiny):
    prompts = ["one two", "three four five"]
    sampled = tiny.generate(prompts, SamplingParams(max_tokens=10, temperature=1.5, top_k=1), use_tqdm=False)
    greedy_out = tiny.generate(prompts, greedy(10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in greedy_out]


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -3}, "top_k"), ({"n": 0}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"), ({"prompt_token_ids": []}, "empty"), ({"prompt_token_ids": [10] * 256}, "max_model_len"),
    ({"prompt_token_ids": [10, 10**9]}, "out of range"), ({"prompt_token_ids": ["x"]}, "list of integers"),
])
def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(tiny, prompt, message):
    with pytest.raises(ValueError, match=message):
        tiny.generate(["fine prompt", prompt], greedy(3), use_tqdm=False)
    assert_idle(tiny)  # nothing half-submitted
    [out] = tiny.generate(["fine prompt"], greedy(3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_max_tokens_is_clipped_to_the_model_length(tiny):
    [out] = tiny.generate([{"prompt_token_ids": [10] * 250}], SamplingParams(max_tokens=None, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_bad_model_paths(tmp_path, tiny_llama_dir):
    from paged_runtime import LLM
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        LLM(model=str(empty), kv_cache_memory=2**20)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt"):
        LLM(model=str(corrupt), kv_cache_memory=2**20)
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError):
        LLM(model=str(bad_gguf))


def test_kv_budget_too_small_names_the_largest_length(tiny_llama_dir):
    from paged_runtime import LLM
    per_block = 16 * 2 * 2 * 2 * 16 * 4  # tokens * (K+V) * layers * kv heads * head dim * fp32
    with pytest.raises(ValueError, match="largest max_model_len that fits is 160"):
        LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=1024, kv_cache_memory=10 * per_block)


@pytest.mark.slow
def test_gguf_file_loads_and_matches_the_converted_default(smol, private_cache):
    from paged_runtime.models.default_model import find_default_gguf
    from_gguf = make_llm(find_default_gguf(), max_model_len=256, kv_cache_memory=16 * 2**20)
    prompt = ["The three primary colors are"]
    assert (from_gguf.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
            == smol.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids)
