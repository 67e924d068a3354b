"""LoRA adapters through ``python -m kserve_adapter`` (a real ModelServer on 127.0.0.1): vLLM's flags
(``--enable-lora --lora-modules``, ``--allow-runtime-lora-updating``, ``--dynamic-lora-loading-path``), every
adapter a model of its own on v1 (``:predict``), v2 (``/infer``, ``/ready``) and the OpenAI routes, listed on
each, behind ``--api-key`` as the base model is. Greedy texts equal peft's on the same adapter. One server
for the module (tests in file order: the listings are checked before adapters are added at runtime); the
start-up checks of the adapters run in-process.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.adapters.test_kserve_server import API_KEY, START_TIMEOUT, KServeProcess, free_port
from tests.helpers.lora import ADAPTERS, make_adapters, peft_greedy
from paged_runtime.config import EngineConfig

pytestmark = [pytest.mark.kserve]

BASE = "base"
PROMPT = "The harbour master wrote"
SAMPLING = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    specs = {name: ADAPTERS[name] for name in ("sql", "mlp")}
    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("kserve-adapters"), specs)


@pytest.fixture(scope="module")
def kserve_lora(tiny_llama_dir, adapters, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kserve-lora")
    dynamic, log = folder / "dynamic", folder / "server.log"
    shutil.copytree(adapters["mlp"], dynamic / "mlp-dyn")
    (dynamic / "big").mkdir()  # of a rank over --max-lora-rank: refused when a request first names it
    (dynamic / "big" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 64, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    port = free_port()
    cmd = [sys.executable, "-m", "kserve_adapter", "--model_name", BASE, "--model", str(tiny_llama_dir),
           "--host", "127.0.0.1", "--http_port", str(port), "--dtype", "float32", "--max-model-len", "128",
           "--kv-cache-memory", "8MiB", "--disable-log-stats", "--api-key", API_KEY,
           "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
           "--lora-modules", f"sql={adapters['sql']}", f"mlp={adapters['mlp']}",
           "--allow-runtime-lora-updating", "--dynamic-lora-loading-path", str(dynamic)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                cwd=Path(__file__).parents[2])
    server = KServeProcess(proc, f"http://127.0.0.1:{port}", port, log, log)
    try:
        server.wait_until(f"/v2/models/{BASE}/ready", 200, START_TIMEOUT)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def oracle(kserve_lora, tiny_llama_dir, adapters):
    """peft's greedy text of each adapter (and of the base model) on the server's own tokens of PROMPT."""
    from transformers import AutoTokenizer
    tokens = kserve_lora.post("/openai/tokenize", {"model": BASE, "prompt": PROMPT}).json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = {name: tokenizer.decode(peft_greedy(tiny_llama_dir, adapters.get(name), [tokens], 8)[0])
             for name in ("sql", "mlp", BASE)}
    assert len(set(texts.values())) == 3  # the test can tell them apart
    return texts


def v1_text(server: KServeProcess, model: str) -> str:
    response = server.post(f"/v1/models/{model}:predict", {"instances": [{"prompt": PROMPT, **SAMPLING}]})
    assert response.status_code == 200, response.text
    return response.json()["predictions"][0]["text"]


def v2_text(server: KServeProcess, model: str) -> str:
    body = {"parameters": SAMPLING, "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                                "data": [PROMPT]}]}
    response = server.post(f"/v2/models/{model}/infer", body)
    assert response.status_code == 200, response.text
    assert response.json()["model_name"] == model
    return response.json()["outputs"][0]["data"][0]


def openai_text(server: KServeProcess, model: str, path: str = "/openai/v1/completions") -> str:
    response = server.post(path, {"model": model, "prompt": PROMPT, **SAMPLING})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def listed(server: KServeProcess) -> dict[str, list[str]]:
    return {"v1": server.get("/v1/models").json()["models"], "v2": server.get("/v2/models").json()["models"],
            "openai": [m["id"] for m in server.get("/openai/v1/models").json()["data"]]}


def test_every_listing_shows_the_adapters_and_they_are_ready(kserve_lora):
    assert listed(kserve_lora) == {key: [BASE, "sql", "mlp"] for key in ("v1", "v2", "openai")}
    for name in ("sql", "mlp"):
        assert kserve_lora.get(f"/v2/models/{name}/ready").json() == {"name": name, "ready": True}
        assert kserve_lora.get(f"/v1/models/{name}").json() == {"name": name, "ready": True}
        metadata = kserve_lora.get(f"/v2/models/{name}").json()
        assert metadata["name"] == name and [t["name"] for t in metadata["inputs"]] == ["text_input"]


def test_each_adapter_answers_as_peft_on_every_protocol(kserve_lora, oracle):
    for name in ("sql", "mlp", BASE):
        expected = oracle[name]
        assert v1_text(kserve_lora, name) == expected, name
        assert v2_text(kserve_lora, name) == expected, name
        assert openai_text(kserve_lora, name) == expected, name
    assert openai_text(kserve_lora, "sql", "/v1/completions") == oracle["sql"]  # the root path too


def test_an_unknown_adapter_is_a_404_on_every_protocol(kserve_lora):
    not_found = {"error": "Model with name nope does not exist."}
    v2 = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    for response in (kserve_lora.post("/v1/models/nope:predict", {"instances": ["hi"]}),
                     kserve_lora.post("/v2/models/nope/infer", v2), kserve_lora.get("/v2/models/nope/ready"),
                     kserve_lora.get("/v1/models/nope"), kserve_lora.get("/v2/models/nope")):
        assert (response.status_code, response.json()) == (404, not_found), response.request.url
    response = kserve_lora.post("/openai/v1/completions", {"model": "nope", "prompt": "hi"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    # base:adapter is the OpenAI routes' spelling; on v1/v2 an adapter goes by its own name
    assert kserve_lora.post(f"/v2/models/{BASE}:sql/infer", v2).status_code == 404


def test_the_adapter_routes_need_the_key_and_their_probes_stay_open(kserve_lora):
    v1 = {"instances": [{"prompt": "hi", "max_tokens": 1}]}
    v2 = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    for method, path, body in [("POST", "/v1/models/sql:predict", v1), ("POST", "/v2/models/sql/infer", v2),
                               ("GET", "/v2/models/sql", None), ("GET", "/v1/models", None),
                               ("POST", "/openai/v1/completions", {"model": "sql", "prompt": "hi"})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.request(method, kserve_lora.url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
    for path in ("/v1/models/sql", "/v2/models/sql/ready"):
        assert kserve_lora.get(path, auth=False).status_code == 200, path


def test_adapters_loaded_and_unloaded_at_runtime_come_and_go_on_v1_v2(kserve_lora, adapters, oracle):
    load = kserve_lora.post("/openai/v1/load_lora_adapter", {"lora_name": "sql2", "lora_path": str(adapters["sql"])})
    assert load.status_code == 200, load.text
    assert all(names[-1] == "sql2" for names in listed(kserve_lora).values())
    assert v1_text(kserve_lora, "sql2") == v2_text(kserve_lora, "sql2") == oracle["sql"]
    unload = kserve_lora.post("/v1/unload_lora_adapter", {"lora_name": "sql2"})  # vLLM's path, at the root
    assert unload.status_code == 200, unload.text
    assert kserve_lora.post("/v1/models/sql2:predict", {"instances": ["hi"]}).status_code == 404
    assert kserve_lora.get("/v2/models/sql2/ready").status_code == 404
    assert all("sql2" not in names for names in listed(kserve_lora).values())


def test_an_adapter_of_the_dynamic_folder_loads_on_first_use_on_v2(kserve_lora, oracle):
    assert "mlp-dyn" not in listed(kserve_lora)["v2"]
    assert v2_text(kserve_lora, "mlp-dyn") == oracle["mlp"]
    assert all("mlp-dyn" in names for names in listed(kserve_lora).values())


def test_an_adapter_that_cannot_run_is_a_400_with_the_reason(kserve_lora, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    load = kserve_lora.post("/openai/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert load.status_code == 400 and "is not LORA" in load.json()["error"]["message"]
    assert kserve_lora.get("/v2/models/bad/ready").status_code == 404
    response = kserve_lora.post("/v1/models/big:predict", {"instances": ["hi"]})
    refused = {"error": "adapter big: rank 64 is over --max-lora-rank 16"}
    assert (response.status_code, response.json()) == (400, refused)
    assert all("big" not in names for names in listed(kserve_lora).values())
    assert "500 Internal Server Error" not in kserve_lora.log_text()


# ---- start-up checks, in-process ------------------------------------------------------------------------
def test_lora_modules_without_enable_lora_exit_2(capsys):
    from kserve_adapter.server import main
    assert main(["--model_name", "m", "--lora-modules", "a=/tmp/a"]) == 2
    assert "--lora-modules and --dynamic-lora-loading-path need --enable-lora" in capsys.readouterr().err


def test_lora_modules_over_a_model_not_served_exit_2(capsys):
    from kserve_adapter.server import main
    module = '{"name": "a", "path": "/tmp/a", "base_model_name": "other"}'
    assert main(["--model_name", "m", "--enable-lora", "--lora-modules", module]) == 2
    assert "adapter 'a' names base model 'other', which this server does not serve" in capsys.readouterr().err


class LoRAEngine:
    """Enough of an engine for the OpenAI app and the start-up check; ``add_lora`` refuses the folder ``bad``."""
    config = EngineConfig(enable_lora=True)
    max_model_len, vocab_size, model_root = 64, 100, "/models/m"
    default_sampling: dict = {}
    is_healthy, tokenizer = True, None

    def __init__(self) -> None:
        self.added: list[str] = []

    async def add_lora(self, request) -> None:
        from paged_runtime.lora.request import LoRAError
        if request.lora_path == "bad":
            raise LoRAError("bad has no adapter_config.json")
        self.added.append(request.lora_name)

    def shutdown(self) -> None:
        self.is_healthy = False


def start_with(modules: list[str]) -> tuple:
    """A model whose start awaits the OpenAI routes' start, as ``server.main`` wires it: (model, repository,
    engine, the start's error or None)."""
    from kserve_adapter.lora import LoRARepository
    from kserve_adapter.model import PagedRuntimeModel
    from kserve_adapter.openai_routes import OpenAIRoutes
    engine = LoRAEngine()
    model = PagedRuntimeModel("m", ["m"], lambda: engine)
    routes = OpenAIRoutes(model, enable_lora=True, lora_modules=modules)
    model.on_engine_up = routes.start
    model.load()
    repository = LoRARepository(routes)
    repository.update(model)
    try:
        asyncio.run(model.start_engine())
    except Exception as e:
        return model, repository, engine, e
    return model, repository, engine, None


def test_before_the_engines_are_up_the_flags_adapters_are_listed_not_ready():
    from kserve_adapter.lora import LoRARepository
    from kserve_adapter.model import PagedRuntimeModel
    from kserve_adapter.openai_routes import OpenAIRoutes
    from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
    from paged_runtime.lora.request import parse_lora_modules
    model = PagedRuntimeModel("m", ["m"], LoRAEngine)
    model.load()
    repository = LoRARepository(OpenAIRoutes(model), LoRAAdapters(["m"], parse_lora_modules(["a=x"]), True))
    repository.update(model)
    assert list(repository.get_models()) == ["m", "a"] and repository.get_model("b") is None
    assert not asyncio.run(repository.is_model_ready("a"))


def test_static_adapters_are_read_once_the_engine_is_up_and_listed():
    model, repository, engine, error = start_with(["a=good", "b=also-good"])
    assert error is None and engine.added == ["a", "b"]  # each read once: the check and the router's start-up
    assert list(repository.get_models()) == ["m", "a", "b"]
    assert asyncio.run(repository.is_model_ready("a")) and repository.get_model("c") is None


def test_a_static_adapter_that_cannot_run_fails_the_models_start_naming_it():
    from kserve_adapter.openai_routes import AdapterStartError
    model, repository, engine, error = start_with(["a=good", "broken=bad"])
    assert isinstance(error, AdapterStartError)
    assert str(error) == ("--lora-modules adapter 'broken' (bad) cannot be served over 'm': "
                          "bad has no adapter_config.json")
    assert not asyncio.run(model.healthy()) and engine.is_healthy is False  # never ready; its engine shut down
