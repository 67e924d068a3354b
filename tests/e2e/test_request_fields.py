"""Request fields end to end through ``LLM``: allowed_token_ids, bad_words, truncate_prompt_tokens, max_logprobs
and the model's generation_config.json defaults (issue 17)."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams
from paged_runtime.sampling_params import ParameterError

PROMPT = {"prompt_token_ids": list(range(1000, 1012))}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=64, max_num_seqs=8, kv_cache_memory=8 * 2**20, max_logprobs=4)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kwargs)


def tokens(llm, params: SamplingParams, prompt=PROMPT) -> list[int]:
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0].token_ids


def single_token(llm, word: str) -> int:
    [token_id] = llm.get_tokenizer().encode(word, add_special_tokens=False)
    return token_id


def test_allowed_token_ids_limit_every_sampled_token(tiny):
    baseline = tokens(tiny, greedy(max_tokens=6))
    assert tokens(tiny, greedy(max_tokens=6, allowed_token_ids=[baseline[0]])) == [baseline[0]] * 6
    allowed = [5, 6, 7]
    sampled = tokens(tiny, SamplingParams(max_tokens=8, ignore_eos=True, seed=1, allowed_token_ids=allowed))
    assert len(sampled) == 8 and set(sampled) <= set(allowed)
    assert_idle(tiny)


def test_bad_words_block_single_and_multi_token_words(tiny):
    cat, dog = single_token(tiny, " cat"), single_token(tiny, " dog")
    only = lambda **kwargs: tokens(tiny, greedy(max_tokens=8, allowed_token_ids=[cat, dog], **kwargs))
    assert only(bad_words=["cat"]) == [dog] * 8  # " cat" (after a space) is blocked everywhere
    assert only(bad_words=["dog"]) == [cat] * 8
    out = only(bad_words=["dog cat"])  # " cat" is blocked right after " dog", and only there
    assert all((a, b) != (dog, cat) for a, b in zip(out, out[1:])), out
    assert_idle(tiny)


def test_bad_words_token_ids_cover_the_word_with_and_without_a_leading_space(tiny):
    tokenizer = tiny.get_tokenizer()
    processor = tiny.engine._processor
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    assert processor.bad_words_token_ids([" dog cat", "dog cat"]) == [encode("dog cat"), encode(" dog cat")]


@pytest.mark.parametrize("k,kept", [(3, 3), (12, 12), (40, 12), (-1, 12)])
def test_truncate_prompt_tokens_keeps_the_last_k(tiny, k, kept):
    processed = tiny.engine.process(PROMPT, SamplingParams(truncate_prompt_tokens=k))
    assert processed.token_ids == PROMPT["prompt_token_ids"][-kept:]


def test_truncate_prompt_tokens_minus_one_fits_the_context(tiny):
    long = {"prompt_token_ids": list(range(1000, 1100))}  # 100 tokens, max_model_len 64
    processed = tiny.engine.process(long, SamplingParams(truncate_prompt_tokens=-1))
    assert processed.token_ids == long["prompt_token_ids"][-63:] and processed.max_tokens == 1
    text = tiny.engine.process("a b c d e f", SamplingParams(truncate_prompt_tokens=2))
    assert (text.prompt, len(text.token_ids)) == (None, 2)  # the text no longer matches the ids


@pytest.mark.parametrize("params,field", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"), ({"logprobs": 5}, "logprobs"), ({"prompt_logprobs": 5}, "prompt_logprobs"),
])
def test_bad_values_name_their_field(tiny, params, field):
    with pytest.raises(ParameterError) as info:
        tiny.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    assert info.value.param == field
    assert_idle(tiny)


def test_max_logprobs_is_the_engines_bound(tiny):
    [out] = tiny.generate([PROMPT], greedy(max_tokens=1, logprobs=4, prompt_logprobs=4), use_tqdm=False)
    assert len(out.outputs[0].logprobs[0]) == 4 and len(out.prompt_logprobs[1]) in (4, 5)
    assert SamplingParams(logprobs=50).logprobs == 50  # no hard cap in SamplingParams itself


# ---- generation_config.json defaults ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def recommending_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a creator's recommendation: greedy, top_p 0.9, at most 3 new tokens (top_k 50 and
    repetition_penalty 1.0 are transformers' own defaults: no recommendation)."""
    folder = tmp_path_factory.mktemp("recommending")
    for path in tiny_llama_dir.iterdir():
        (folder / path.name).symlink_to(path)
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "top_p": 0.9, "top_k": 50,
         "repetition_penalty": 1.0, "max_new_tokens": 3, "do_sample": True}))
    return folder


def test_default_sampling_from_the_models_generation_config(recommending_dir, tiny_llama_dir, tmp_path):
    from paged_runtime.engine.generation_config import default_sampling
    assert default_sampling(recommending_dir) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 3}
    assert default_sampling(recommending_dir, "vllm") == {}
    assert default_sampling(tiny_llama_dir, str(recommending_dir)) == {"temperature": 0.0, "top_p": 0.9,
                                                                        "max_tokens": 3}
    assert default_sampling(tmp_path) == {}  # no file: no defaults
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        default_sampling(tiny_llama_dir, str(tmp_path))
    shutil.copy(recommending_dir / "generation_config.json", tmp_path / "generation_config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="recommends a sampling value this runtime cannot use"):
        default_sampling(tmp_path)


def test_llm_uses_the_recommended_defaults_when_given_no_params(recommending_dir, tiny, caplog):
    with caplog.at_level("INFO", logger="paged_runtime.engine.generation_config"):
        llm = make_llm(recommending_dir, max_model_len=64, max_num_seqs=4, kv_cache_memory=4 * 2**20)
    assert "default sampling parameters from the model's generation_config.json" in caplog.text
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.9, max_tokens=3)
    [out] = llm.generate([PROMPT], use_tqdm=False)
    assert out.outputs[0].token_ids == tokens(tiny, SamplingParams(temperature=0, max_tokens=3))
    plain = make_llm(recommending_dir, max_model_len=64, max_num_seqs=4, kv_cache_memory=4 * 2**20,
                     generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_llm_chat_takes_a_chat_template(tiny):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    [out] = tiny.chat([{"role": "user", "content": "hi"}], greedy(max_tokens=1), use_tqdm=False,
                      chat_template=template)
    assert out.prompt_token_ids == tiny.get_tokenizer().encode("<user>hi", add_special_tokens=False)
