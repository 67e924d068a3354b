"""LoRA adapters through the OpenAI routes, with vLLM's flags and routes: ``--enable-lora --lora-modules``,
``/v1/models`` listing adapters with their ``parent``, a request's ``model`` picking an adapter (by name or as
``base:adapter``), ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` behind
``--allow-runtime-lora-updating``, adapters loaded on first use from ``--dynamic-lora-loading-path``, and
``vllm:lora_requests_info``. Greedy tokens equal peft's on the same adapter; bad input gets its 4xx and nothing
else changes.
"""
from __future__ import annotations

import shutil

import httpx
import pytest

from tests.helpers.lora import make_adapter, make_adapters, peft_greedy
from tests.server.conftest import serving

PROMPT_IDS = [1, 504, 3012, 7891, 42, 17, 9000, 4518]
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB", "--debug-checks",
                "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--disable-log-stats"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("http-adapters"))


@pytest.fixture(scope="module")
def dynamic_dir(adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamic")
    shutil.copytree(adapters["mlp"], root / "mlp-dyn")
    return root


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters, dynamic_dir):
    from prometheus_client import CollectorRegistry

    from paged_runtime.entrypoints.cli import build_parser, engine_config, make_engine, server_config
    from paged_runtime.entrypoints.openai import app_options, build_app
    args = build_parser().parse_args([
        "serve", str(tiny_llama_dir), "--served-model-name", "base", *ENGINE_FLAGS,
        "--lora-modules", f"sql={adapters['sql']}",
        f'{{"name": "chat", "path": "{adapters["chat"]}", "base_model_name": "base"}}',
        "--allow-runtime-lora-updating", "--dynamic-lora-loading-path", str(dynamic_dir)])
    settings = server_config(args)
    registry = CollectorRegistry()
    engine = make_engine(engine_config(args), settings, registry)
    try:
        with serving(build_app(engine, registry=registry, enable_lora=True, **app_options(settings))) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, adapters):
    """peft's greedy text of each adapter (and the base model's)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = {name: tokenizer.decode(peft_greedy(tiny_llama_dir, adapters[name] if name else None, [PROMPT_IDS], 8)[0])
             for name in ("sql", "chat", "mlp", None)}
    assert len(set(texts.values())) == 4  # the test can tell them apart
    return texts


def complete(url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_models_list_adapters_with_their_parent(server, adapters):
    url, _ = server
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert [m["id"] for m in data] == ["base", "sql", "chat"]
    assert by_id["sql"]["parent"] == "base" and by_id["sql"]["root"] == str(adapters["sql"])
    assert by_id["base"]["parent"] is None


def test_each_model_name_runs_its_adapter(server, oracle):
    url, _ = server
    assert text(complete(url, "sql")) == oracle["sql"]
    assert text(complete(url, "base:chat")) == oracle["chat"]
    assert text(complete(url, "base")) == oracle[None]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "chat", "max_tokens": 3, "temperature": 0,
                                                           "messages": [{"role": "user", "content": "hi"}]},
                      timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "chat"


def test_an_adapter_in_the_dynamic_folder_loads_on_first_use(server, oracle):
    url, _ = server
    assert text(complete(url, "mlp-dyn")) == oracle["mlp"]
    assert "mlp-dyn" in [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def test_unknown_adapter_is_a_404_naming_it(server):
    url, _ = server
    for name in ("nope", "base:nope", "../sql"):
        response = complete(url, name)
        assert response.status_code == 404, name
        assert response.json()["error"]["code"] == "model_not_found"
        assert name.split(":")[-1] in response.json()["error"]["message"]


def test_load_and_unload_at_runtime(server, adapters, oracle):
    url, engine = server
    load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp2", "lora_path": str(adapters["mlp"])},
                      timeout=60)
    assert load.status_code == 200 and "mlp2" in load.text
    assert text(complete(url, "mlp2")) == oracle["mlp"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp2", "lora_path": str(adapters["mlp"])},
                       timeout=60)
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_adapter_exists"
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp2"}, timeout=60)
    assert unload.status_code == 200
    assert complete(url, "mlp2").status_code == 404
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp2"}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_adapter_not_found"


@pytest.mark.parametrize("body,fragment", [
    ({"lora_name": "big", "lora_path": "CHAT_RANK"}, "over --max-lora-rank"),
    ({"lora_name": "none", "lora_path": "/nonexistent/adapter"}, "has no adapter_config.json"),
    ({"lora_name": "base", "lora_path": "SQL"}, "name of a served model"),
    ({"lora_name": ""}, "lora_name"),
])
def test_an_adapter_that_cannot_load_is_a_400(server, adapters, tiny_llama_dir, tmp_path, body, fragment):
    url, engine = server
    if body.get("lora_path") == "CHAT_RANK":  # rank 16 fits; one of rank 32 does not
        body["lora_path"] = str(make_adapter(tiny_llama_dir, tmp_path / "r32", r=32, targets=["q_proj"], seed=9))
    elif body.get("lora_path") == "SQL":
        body["lora_path"] = str(adapters["sql"])
    response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert fragment in response.text
    names = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert "big" not in names and "none" not in names


def test_lora_requests_info_metric(server):
    from prometheus_client.parser import text_string_to_metric_families
    url, _ = server
    assert complete(url, "sql").status_code == 200
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if f.name == "vllm:lora_requests_info"]
    assert len(samples) == 1
    assert samples[0].labels["max_lora"] == "2"
    assert samples[0].labels["running_lora_adapters"] == "" and samples[0].labels["waiting_lora_adapters"] == ""
