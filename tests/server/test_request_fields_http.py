"""Issue 17 on the OpenAI routes: prompt_logprobs, echo with max_tokens 0 (scoring), allowed_token_ids, bad_words,
truncate_prompt_tokens; vLLM fields this server refuses; unknown fields logged once; the model's
generation_config.json defaults, --chat-template and --max-logprobs."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

from paged_runtime import SamplingParams

from .conftest import TINY_NAME, running_server, sse_events

MESSAGES = [{"role": "user", "content": "Say something."}]
PROMPT = "The sea is"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def error_of(response: httpx.Response) -> tuple[int, str | None, str | None]:
    error = response.json()["error"]
    return response.status_code, error["param"], error["code"]


def token_ids(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


# ---- prompt_logprobs ---------------------------------------------------------------------------------------
def expected_prompt_logprobs(llm, prompt, k: int) -> list:
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return [None] + [{str(t): (lp.rank, lp.decoded_token, lp.logprob) for t, lp in entry.items()
                      if t == token or lp.rank <= k}
                     for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def assert_same_prompt_logprobs(got: list, expected: list) -> None:
    assert len(got) == len(expected) and got[0] is None
    for g, e in zip(got[1:], expected[1:]):
        assert g.keys() == e.keys()
        for token, (rank, decoded, logprob) in e.items():
            assert (g[token]["rank"], g[token]["decoded_token"]) == (rank, decoded)
            assert g[token]["logprob"] == pytest.approx(logprob, abs=1e-4)


def test_completions_prompt_logprobs_in_each_choice(tiny_server, tiny_llm):
    body = post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2,
                                                 "prompt_logprobs": 2}).json()
    expected = expected_prompt_logprobs(tiny_llm, PROMPT, 2)
    assert len(body["choices"]) == 2
    for choice in body["choices"]:
        assert_same_prompt_logprobs(choice["prompt_logprobs"], expected)
    plain = post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_chat_prompt_logprobs_in_the_response(tiny_server, tiny_llm):
    body = post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                                                      "prompt_logprobs": 0}).json()
    ids = post(tiny_server, "/tokenize", {"messages": MESSAGES})
    expected = expected_prompt_logprobs(tiny_llm, {"prompt_token_ids": ids.json()["tokens"]}, 0)
    assert_same_prompt_logprobs(body["prompt_logprobs"], expected)
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])  # k = 0: the prompt's own token


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True, "prompt_logprobs": 1}),
])
def test_prompt_logprobs_cannot_stream(tiny_server, path, body):
    assert error_of(post(tiny_server, path, body)) == (400, "prompt_logprobs", None)


# ---- echo with max_tokens 0: scoring -------------------------------------------------------------------------
def test_echo_with_max_tokens_0_scores_the_prompt(tiny_server, tiny_llm):
    body = post(tiny_server, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0,
                                                 "logprobs": 1}).json()
    [choice] = body["choices"]
    ids = token_ids(tiny_llm, PROMPT)
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (PROMPT, "length", None)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tiny_llm.get_tokenizer().decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = expected_prompt_logprobs(tiny_llm, PROMPT, 1)
    for position in range(1, len(ids)):
        own = expected[position][str(ids[position])]
        assert logprobs["token_logprobs"][position] == pytest.approx(own[2], abs=1e-4)
        assert len(logprobs["top_logprobs"][position]) in (1, 2)  # the top one, and the prompt's own if not it


def test_echo_with_max_tokens_0_streams_the_prompt_only(tiny_server):
    response = post(tiny_server, "/v1/completions", {"prompt": [PROMPT, "Hi"], "echo": True, "max_tokens": 0,
                                                     "stream": True,
                                                     "stream_options": {"include_usage": True}})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    assert (texts, reasons) == ({0: PROMPT, 1: "Hi"}, {0: "length", 1: "length"})
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_0_without_echo_is_refused(tiny_server):
    assert error_of(post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})) == (
        400, "max_tokens", "invalid_value")


# ---- allowed_token_ids, bad_words, truncate_prompt_tokens -----------------------------------------------------
def test_allowed_token_ids_and_bad_words(tiny_server, tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    [cat], [dog] = (tokenizer.encode(w, add_special_tokens=False) for w in (" cat", " dog"))
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "allowed_token_ids": [cat, dog]}
    assert post(tiny_server, "/v1/completions", {**body, "bad_words": ["cat"]}).json()["choices"][0]["text"] == \
        " dog" * 4
    chat = post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                      "ignore_eos": True, "allowed_token_ids": [cat, dog],
                                                      "bad_words": ["dog"]}).json()
    assert chat["choices"][0]["message"]["content"] == " cat" * 4


def test_truncate_prompt_tokens(tiny_server):
    body = post(tiny_server, "/v1/completions", {"prompt": "one two three four five six", "max_tokens": 1,
                                                 "truncate_prompt_tokens": 2, "echo": True}).json()
    assert body["usage"]["prompt_tokens"] == 2 and body["choices"][0]["text"].startswith(" five six")
    chat = post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                      "truncate_prompt_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [49152]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": MESSAGES, "bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "truncate_prompt_tokens": -3}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_field_values_are_400_naming_the_field(tiny_server, path, body, param):
    response = post(tiny_server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ---- refused and unknown fields ------------------------------------------------------------------------------
REFUSED = [
    ("/v1/completions", "use_beam_search", True), ("/v1/completions", "length_penalty", 0.5),
    ("/v1/completions", "logits_processors", ["my.Processor"]), ("/v1/completions", "vllm_xargs", {"a": 1}),
    ("/v1/completions", "kv_transfer_params", {}), ("/v1/completions", "mm_processor_kwargs", {}),
    ("/v1/completions", "return_tokens_as_token_ids", True), ("/v1/completions", "prompt_embeds", "AAAA"),
    ("/v1/completions", "add_special_tokens", False),
    ("/v1/chat/completions", "use_beam_search", True), ("/v1/chat/completions", "length_penalty", 2.0),
    ("/v1/chat/completions", "logits_processors", ["my.Processor"]), ("/v1/chat/completions", "vllm_xargs", {"a": 1}),
    ("/v1/chat/completions", "kv_transfer_params", {}), ("/v1/chat/completions", "mm_processor_kwargs", {}),
    ("/v1/chat/completions", "return_tokens_as_token_ids", True), ("/v1/chat/completions", "best_of", 2),
    ("/v1/chat/completions", "echo", True), ("/v1/chat/completions", "add_special_tokens", True),
    ("/v1/chat/completions", "documents", [{"title": "t", "text": "x"}]),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
]


@pytest.mark.parametrize("path,field,value", REFUSED, ids=[f"{p.split('/')[-1]}-{f}" for p, f, _ in REFUSED])
def test_vllm_fields_this_server_does_not_implement_are_refused(tiny_server, path, field, value):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    assert error_of(post(tiny_server, path, {**base, "max_tokens": 1, field: value})) == (
        400, field, "unsupported_parameter")


def test_continuous_usage_stats_is_refused(tiny_server):
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert error_of(post(tiny_server, "/v1/completions", body)) == (
        400, "stream_options.continuous_usage_stats", "unsupported_parameter")


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "use_beam_search", False), ("/v1/completions", "length_penalty", 1.0),
    ("/v1/completions", "add_special_tokens", True), ("/v1/chat/completions", "add_special_tokens", False),
    ("/v1/chat/completions", "echo", False), ("/v1/chat/completions", "logits_processors", None),
])
def test_refusable_fields_at_their_defaults_are_accepted(tiny_server, path, field, value):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    assert post(tiny_server, path, {**base, "max_tokens": 1, field: value}).status_code == 200


def test_unknown_fields_are_ignored_and_logged_once(tiny_server, caplog):
    body = {"prompt": PROMPT, "max_tokens": 1, "some_future_field_17": {"x": 1}}
    with caplog.at_level(logging.DEBUG, logger="paged_runtime.entrypoints.openai.protocol"):
        assert post(tiny_server, "/v1/completions", body).status_code == 200
        assert post(tiny_server, "/v1/completions", body).status_code == 200
    assert [r.getMessage() for r in caplog.records if "some_future_field_17" in r.getMessage()] == [
        "request field 'some_future_field_17' is not known to this server and is ignored"]


# ---- a server with the model's defaults, --chat-template and --max-logprobs -----------------------------------
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def configured_server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("recommending-http")
    for path in tiny_llama_dir.iterdir():
        if path.name != "generation_config.json":
            (folder / path.name).symlink_to(path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0,
                                                               "max_new_tokens": 3}))
    with running_server(folder, TINY_NAME, max_model_len=128, max_num_seqs=8, kv_cache_memory=8 * 2**20,
                        max_logprobs=2, app_options={"chat_template": TEMPLATE}) as server:
        yield server


def test_the_models_defaults_apply_when_the_request_leaves_the_field_unset(configured_server, tiny_llm):
    assert configured_server.engine.default_sampling == {"temperature": 0.0, "max_tokens": 3}
    body = post(configured_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "ignore_eos": True}).json()
    [greedy] = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                 use_tqdm=False)
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == (
        greedy.outputs[0].text, "length", 3)  # max_new_tokens caps max_tokens, as vLLM
    chat = post(configured_server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 3


def test_chat_template_flag_replaces_the_tokenizers(configured_server, tiny_llm):
    body = post(configured_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert body["tokens"] == tiny_llm.get_tokenizer().encode("[user] Say something.\n", add_special_tokens=False)
    chat = post(configured_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(body["tokens"])


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 3}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
])
def test_max_logprobs_bounds_every_logprobs_field(configured_server, path, body, param):
    response = post(configured_server, path, body)
    assert error_of(response) == (400, param, "invalid_value")
    assert "at most this server's max_logprobs (2)" in response.json()["error"]["message"]
    assert post(configured_server, path, {**body, param: 2} if param != "top_logprobs"
                else {**body, "top_logprobs": 2}).status_code == 200
