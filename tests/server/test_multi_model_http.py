"""Several models behind one server (``--models-dir``, ``--max-loaded-models``): each request reaches the model it
names (greedy tokens equal that model's offline ``LLM``), a model loads on its first request and the least
recently used idle one is unloaded to make room, /v1/models shows each one's state, metrics carry each model's
name (and lose an unloaded model's series), and the errors name only what the client sent.

Two tiny random Llamas of different weights, so a request answered by the wrong model cannot pass."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import make_llm
from tests.server.conftest import serving

PROMPT = "The harbour master wrote"
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB", "--debug-checks"]


@pytest.fixture(scope="module")
def models_dir(two_models_dir):
    return two_models_dir


@pytest.fixture(scope="module")
def server(models_dir):
    from prometheus_client import CollectorRegistry

    from paged_runtime.entrypoints.cli import build_parser, engine_configs, make_model_set, server_config
    from paged_runtime.entrypoints.openai import app_options, build_app
    args = build_parser().parse_args(["serve", "--models-dir", str(models_dir), "--max-loaded-models", "1",
                                      "--disable-log-stats", *ENGINE_FLAGS])
    settings = server_config(args)
    registry = CollectorRegistry()
    model_set = make_model_set(engine_configs(args, settings), settings, registry)
    try:
        with serving(build_app(model_set, registry=registry, **app_options(settings))) as url:
            yield url, model_set
    finally:
        model_set.shutdown()


def expected_tokens(model_dir, max_tokens=12) -> list[int]:
    from paged_runtime import SamplingParams
    llm = make_llm(model_dir, max_model_len=128, kv_cache_memory=8 * 2**20)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def reference(models_dir):
    tokens = {name: expected_tokens(models_dir / name) for name in ("alpha", "beta")}
    assert tokens["alpha"] != tokens["beta"]  # the test can tell the models apart
    return tokens


def complete(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def text(response: httpx.Response) -> str:
    return response.json()["choices"][0]["text"]


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def metric_models(url: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.labels["model_name"] for f in text_string_to_metric_families(text) for s in f.samples
            if f.name == "vllm:request_success"}


def test_requests_load_their_model_and_the_least_recently_used_idle_one_makes_room(server, reference, models_dir):
    from transformers import AutoTokenizer
    url, _ = server
    tokenizer = AutoTokenizer.from_pretrained(models_dir / "alpha")
    listed = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["status"], m["root"], m["max_model_len"]) for m in listed] == [
        ("alpha", {"value": "unloaded"}, str(models_dir / "alpha"), None),
        ("beta", {"value": "unloaded"}, str(models_dir / "beta"), None)]

    response = complete(url, "alpha")
    assert response.status_code == 200 and response.json()["model"] == "alpha"
    assert text(response) == tokenizer.decode(reference["alpha"])
    assert states(url) == {"alpha": "loaded", "beta": "unloaded"} and metric_models(url) == {"alpha"}

    response = complete(url, "beta")
    assert text(response) == tokenizer.decode(reference["beta"])
    assert states(url) == {"alpha": "unloaded", "beta": "loaded"}
    assert metric_models(url) == {"beta"}  # the unloaded model's series went with its engine

    response = complete(url, "alpha")  # loaded again, same answer
    assert text(response) == tokenizer.decode(reference["alpha"])
    assert states(url) == {"alpha": "loaded", "beta": "unloaded"}


def test_a_stream_to_an_unloaded_model_waits_for_its_load(server, reference, models_dir):
    from transformers import AutoTokenizer
    url, model_set = server
    httpx.post(f"{url}/models/unload", json={"model": "alpha"}, timeout=60).raise_for_status()
    assert all(state == "unloaded" for state in states(url).values())
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"model": "beta", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1] if json.loads(line)["choices"])
    tokenizer = AutoTokenizer.from_pretrained(models_dir / "beta")
    assert text == tokenizer.decode(reference["beta"])
    assert states(url)["beta"] == "loaded"
    httpx.post(f"{url}/models/load", json={"model": "alpha"}, timeout=120).raise_for_status()
    assert states(url) == {"alpha": "loaded", "beta": "unloaded"}
    assert [m.engine.num_unfinished_requests for m in model_set.models if m.engine is not None] == [0]


def test_unknown_and_missing_models_name_only_what_was_sent(server, models_dir):
    url, _ = server
    response = complete(url, "gamma")
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model") and "gamma" in error["message"]
    assert str(models_dir) not in response.text
    response = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    response = httpx.post(f"{url}/models/unload", json={"model": "gamma"}, timeout=30)
    assert response.status_code == 404
