"""kserve_adapter in-process: its command line, the model's engine lifecycle, the engine-error responses.

The HTTP behaviour is tested against a real server in test_kserve_server.py.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi import FastAPI
from kserve.errors import InvalidInput
from fastapi.testclient import TestClient

from kserve_adapter.args import build_parser, parse_args, resolve_model
from kserve_adapter.model import LOAD_GATE_ENV, PagedRuntimeModel
from kserve_adapter.protocol import PromptRequest, v1_prepare, v2_fields, v2_texts
from kserve_adapter.server import add_engine_error_handlers
from paged_runtime.config import EngineConfig
from paged_runtime.entrypoints.cli import engine_config, server_config
from paged_runtime.engine.async_engine import EngineDeadError, EngineOverloadedError

RUNTIME_FLAGS = ["--served-model-name", "--api-key", "--max-waiting-requests", "--dtype", "--device", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--kv-cache-memory",
                 "--gpu-memory-utilization", "--enable-prefix-caching", "--no-enable-prefix-caching", "--seed",
                 "--scheduling-policy", "--tensor-parallel-size", "--speculative-config"]
KSERVE_FLAGS = ["--model_name", "--http_port", "--grpc_port", "--workers", "--enable_grpc", "--max_asyncio_workers"]


def test_parser_has_kserve_and_runtime_flags():
    options = {s for action in build_parser()._actions for s in action.option_strings}
    assert set(RUNTIME_FLAGS + KSERVE_FLAGS + ["--model", "--model_dir", "--host"]) <= options


def test_model_is_not_swallowed_by_model_name_and_defaults_follow_kserve(tmp_path):
    args = parse_args(["--model_name", "m", "--model", str(tmp_path), "--max-model-len", "256",
                       "--kv-cache-memory", "8MiB", "--no-enable-prefix-caching"])
    config = engine_config(args)
    assert (args.model_name, config.model, config.max_model_len, config.kv_cache_memory) == (
        "m", str(tmp_path), 256, 8 * 2**20)
    assert (config.enable_prefix_caching, config.served_model_name, args.http_port, args.host, args.enable_grpc) == (
        False, ["m"], 8080, "0.0.0.0", False)
    assert engine_config(parse_args(["--model_name", "m", "--served-model-name", "a", "b"])).served_model_name == [
        "a", "b"]


@pytest.mark.parametrize("argv,message", [
    (["--workers", "2"], "--workers must be 1, got 2"),
    (["--model", "/no/such/model"], "--model '/no/such/model' does not exist"),
    (["--model_nam", "x"], "unrecognized arguments: --model_nam x"),  # no abbreviations
])
def test_refused_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_flags_the_runtime_refuses_exit_2_before_serving(capsys):
    from kserve_adapter.server import main
    assert main(["--model_name", "m", "--tensor-parallel-size", "2", "--async-scheduling"]) == 2
    assert "kserve_adapter: error: async_scheduling needs one device" in capsys.readouterr().err


def test_resolve_model_from_model_dir(tmp_path):
    assert resolve_model(None, None) is None
    assert resolve_model(None, str(tmp_path / "missing")) is None  # no storageUri: the embedded default
    assert resolve_model(None, str(tmp_path)) is None  # empty
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model(None, str(tmp_path)) == str(tmp_path / "model.gguf")  # a storageUri to one GGUF
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(None, str(tmp_path)) == str(tmp_path)  # a Hugging Face folder
    assert resolve_model("/explicit", str(tmp_path)) == "/explicit"


# ---- the model's engine lifecycle ----------------------------------------------------------------
class FakeEngine:
    max_model_len = 64
    config = EngineConfig()
    default_sampling: dict = {}
    is_healthy = True
    tokenizer = None  # the serving objects take their own copy of it

    def __init__(self) -> None:
        self.num_shutdowns = 0

    def shutdown(self) -> None:
        self.num_shutdowns += 1
        self.is_healthy = False


def test_healthy_only_once_the_engine_is_built_and_until_it_stops():
    engine = FakeEngine()
    model = PagedRuntimeModel("m", ["m"], lambda: engine)
    assert model.load() and model.ready and model.engine is True

    async def run() -> list[bool]:
        before = await model.healthy()
        await model.start_engine()
        during = await model.healthy()
        model.stop_engine()
        model.stop_engine()  # idempotent
        return [before, during, await model.healthy()]

    assert asyncio.run(run()) == [False, True, False]
    assert engine.num_shutdowns == 1


def test_stop_while_the_load_gate_is_closed_never_builds(monkeypatch, tmp_path):
    monkeypatch.setenv(LOAD_GATE_ENV, str(tmp_path / "gate"))
    builds = []
    model = PagedRuntimeModel("m", ["m"], lambda: builds.append(1))

    async def run() -> None:
        start = asyncio.create_task(model.start_engine())
        await asyncio.sleep(0)  # let it reach the gate
        model.stop_engine()
        await asyncio.wait_for(start, 10)

    asyncio.run(run())
    assert builds == [] and model.async_engine is None


def test_stop_while_building_shuts_the_engine_down_once_built():
    building, release, engine = threading.Event(), threading.Event(), FakeEngine()

    def build() -> FakeEngine:
        building.set()
        assert release.wait(10)
        return engine

    model = PagedRuntimeModel("m", ["m"], build)

    async def run() -> None:
        start = asyncio.create_task(model.start_engine())
        assert await asyncio.to_thread(building.wait, 10)
        model.stop_engine()  # SIGTERM while the weights load
        release.set()
        await asyncio.wait_for(start, 10)

    asyncio.run(run())
    assert engine.num_shutdowns == 1 and model.async_engine is None and not asyncio.run(model.healthy())


# ---- engine errors on KServe's routes ------------------------------------------------------------
def test_engine_errors_are_503_with_a_kserve_body():
    app = FastAPI()
    add_engine_error_handlers(app)

    @app.get("/full")
    async def full():
        raise EngineOverloadedError("the server is overloaded", retry_after=3)

    @app.get("/dead")
    async def dead():
        raise EngineDeadError("the engine failed: boom")

    client = TestClient(app)
    response = client.get("/full")
    assert (response.status_code, response.json(), response.headers["retry-after"]) == (
        503, {"error": "the server is overloaded"}, "3")
    response = client.get("/dead")
    assert (response.status_code, response.json()) == (503, {"error": "the engine failed: boom"})


# ---- the OpenAI routes' edge checks on KServe's app -------------------------------------------------
class RoutesEngine(FakeEngine):
    """Enough of an engine to build the OpenAI app; the requests here are refused before they reach it."""
    model_root = "/models/m"
    vocab_size = 100


def test_openai_routes_keep_the_edge_checks():
    """415 unless JSON, 413 beyond the body limit, 400 for a lone surrogate or deep nesting, under both
    KServe's /openai prefix and the root /v1 paths; CORS only for the allowed origin."""
    from kserve_adapter.openai_routes import OpenAIRoutes, mount_openai_routes
    engine = RoutesEngine()
    model = PagedRuntimeModel("m", ["m"], lambda: engine)
    model.load()
    asyncio.run(model.start_engine())
    app = FastAPI()
    mount_openai_routes(app, OpenAIRoutes(model, max_request_body_bytes=1024,
                                          allowed_origins=["https://good.example"]))
    client = TestClient(app)
    json_type = {"Content-Type": "application/json"}
    for path in ("/openai/v1/completions", "/v1/completions", "/openai/v1/chat/completions", "/openai/tokenize"):
        error = client.post(path, content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
        assert (error.status_code, error.json()["error"]["code"]) == (415, "unsupported_media_type"), path
        error = client.post(path, content=b'{"prompt": "' + b"x" * 1024 + b'"}', headers=json_type)
        assert (error.status_code, error.json()["error"]["code"]) == (413, "request_too_large"), path
        error = client.post(path, content=b'{"model": "\\ud800"}', headers=json_type)
        assert (error.status_code, error.json()["error"]["param"]) == (400, "model"), path
        error = client.post(path, content=b"[" * 1000, headers=json_type)
        assert (error.status_code, error.json()["error"]["code"]) == (400, "invalid_json"), path
    preflight = {"Access-Control-Request-Method": "POST", "Origin": "https://good.example"}
    allowed = client.options("/openai/v1/completions", headers=preflight)
    assert allowed.headers["access-control-allow-origin"] == "https://good.example"
    refused = client.options("/openai/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in refused.headers


@pytest.mark.parametrize("raw,message", [
    (b'{"instances": ["\\ud800"]}', "lone UTF-16 surrogate"),
    (b'{"instances": [' + b"[" * 100_000 + b"]}", "nests deeper than"),
    (b'{"instances": [{"prompt": "hi", "stop": ' + b"[" * 100 + b"]" * 100 + b"}]}", "nests deeper than"),
])
def test_v1_raw_body_is_refused_like_the_openai_routes(raw, message):
    """A v1 body KServe passes on unparsed (no JSON Content-Type) gets the OpenAI routes' parser."""
    with pytest.raises(InvalidInput, match=message):
        v1_prepare(None, raw)  # refused before the serving object is needed


# ---- v2 over gRPC --------------------------------------------------------------------------------
def test_v2_grpc_request_gives_texts_and_plain_parameters():
    """gRPC requests carry bytes and protobuf parameters (no floats: a float comes as a string)."""
    from kserve.protocol.grpc.grpc_predict_v2_pb2 import ModelInferRequest
    from kserve.protocol.infer_type import InferRequest
    proto = ModelInferRequest(model_name="m", id="r1")
    proto.parameters["max_tokens"].int64_param = 4
    proto.parameters["temperature"].string_param = "0.5"
    proto.parameters["ignore_eos"].bool_param = True
    proto.parameters["binary_data_output"].bool_param = True  # KServe's own: not a sampling field
    tensor = proto.inputs.add(name="text_input", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend(["héllo".encode(), b"world"])
    request = InferRequest.from_grpc(proto)
    assert v2_texts(request) == ["héllo", "world"]
    fields = v2_fields(request)
    assert fields == {"max_tokens": 4, "temperature": "0.5", "ignore_eos": True}
    req = PromptRequest.model_validate({"prompt": "x", **fields})
    assert (req.max_tokens, req.temperature, req.ignore_eos) == (4, 0.5, True)


def test_the_edge_flags_reach_the_openai_app():
    from paged_runtime.entrypoints.openai import app_options
    args = parse_args(["--model_name", "m", "--max-request-body-bytes", "1MiB", "--max-prompts-per-request", "3",
                       "--allowed-origins", "https://app.example.com", "--metrics-require-api-key",
                       "--chat-template", "{{ messages[0]['content'] }}", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--api-key", "k1", "k2",
                       "--enable-prompt-tokens-details", "--allowed-hosts", "llm.internal"])
    from paged_runtime.entrypoints.openai.access import ApiKeys
    from paged_runtime.entrypoints.openai.serving_chat import ChatOptions
    assert app_options(server_config(args), bind_host=args.host) == {
        "api_key": ApiKeys(["k1", "k2"]), "allowed_hosts": ["llm.internal"], "enable_prompt_tokens_details": True,
        "allowed_origins": ["https://app.example.com"], "max_request_body_bytes": 2**20,
                                  "max_prompts_per_request": 3, "metrics_require_api_key": True,
                                  "chat_template": "{{ messages[0]['content'] }}",
                                  "chat_options": ChatOptions(True, "hermes", "qwen3"),
                                  "responses_store_max_entries": 1024, "responses_store_max_bytes": 64 * 2**20,
                                  "lora_modules": None, "allow_runtime_lora_updating": False,
                                  "dynamic_lora_loading_path": None}


# ---- KServe's own inference routes: off the loop, the configured limits, a body limit ------------------
class GatedTokenizer:
    """Tokenizes one token per character, but only once ``release`` is set (a long prompt's tokenization)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __deepcopy__(self, memo: dict) -> GatedTokenizer:
        return self  # the serving object's private copy is this one: the test holds its events

    def __len__(self) -> int:
        return 51

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["t"] * len(ids)  # one character per token, as encode below

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if not self.release.wait(10):  # only the event loop sets it: it waits here forever if held
            raise AssertionError("the prompt was tokenized on the event loop: nothing else could run")
        return [1 + ord(c) % 50 for c in text]


class OneTokenStream:
    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id, self.finished = request_id, False
        self.prompt_token_ids = prompt_token_ids

    async def __aiter__(self):
        from paged_runtime.outputs import CompletionOutput, RequestOutput
        self.finished = True
        yield RequestOutput(self.request_id, None, self.prompt_token_ids,
                            [CompletionOutput(0, "!", [7], finish_reason="length")], finished=True)

    def abort(self) -> None:
        pass


class PredictEngine(FakeEngine):
    """Answers every prompt with one token "!"; tokenizes text with its tokenizer, as the runtime's engine."""
    max_model_len = 64
    vocab_size = 100
    model_root = "/models/m"

    def __init__(self, tokenizer: object = None) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.submitted: list[str] = []

    def process(self, prompt, params):
        from paged_runtime.engine.processor import ProcessedPrompt
        if isinstance(prompt, dict):
            token_ids = prompt["prompt_token_ids"]
        else:
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return ProcessedPrompt(None, token_ids, params.max_tokens)

    def add_request(self, request_id, prompt, params, priority=0, cache_salt=None, pooling=None, lora_request=None):
        self.submitted.append(request_id)
        self.salts.append(cache_salt)
        return OneTokenStream(request_id, prompt.token_ids)

    @property
    def salts(self) -> list:
        return self.__dict__.setdefault("_salts", [])


def started_model(engine: PredictEngine, limits=None, api_keys=None) -> PagedRuntimeModel:
    model = PagedRuntimeModel("m", ["m"], lambda: engine, **({} if limits is None else {"limits": limits}),
                              api_keys=api_keys)
    model.load()
    asyncio.run(model.start_engine())
    return model


@pytest.mark.parametrize("payload", ["v1", "v2"])
def test_predict_tokenizes_on_the_tokenizer_worker_not_the_event_loop(payload):
    """While a long prompt is tokenized, the event loop (health routes included) keeps running."""
    from kserve.protocol.infer_type import InferInput, InferRequest
    tokenizer = GatedTokenizer()
    model = started_model(PredictEngine(tokenizer))
    request = ({"instances": ["hello"]} if payload == "v1" else
               InferRequest("m", [InferInput("text_input", [1], "BYTES", ["hello"])]))

    async def run():
        predict = asyncio.create_task(model.predict(request))
        assert await asyncio.to_thread(tokenizer.entered.wait, 10)
        tokenizer.release.set()  # another coroutine runs while the prompt is tokenized
        return await asyncio.wait_for(predict, 10)

    response = asyncio.run(run())
    if payload == "v1":
        assert response == {"predictions": [{"text": "!", "finish_reason": "length",
                                             "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                                       "total_tokens": 6}}]}
    else:
        assert response.outputs[0].data == ["!"] and response.parameters["prompt_tokens"] == 5
    assert len(tokenizer.threads) == 1 and tokenizer.threads[0].startswith("tokenizer")  # the worker's thread


def test_the_configured_limits_reach_the_models_serving_object():
    from kserve_adapter.server import build_model
    from paged_runtime.entrypoints.openai.serving import RequestLimits
    args = parse_args(["--model_name", "m", "--max-request-body-bytes", "1KiB", "--max-prompts-per-request", "3"])
    model = build_model(args.model_name, engine_config(args), server_config(args))
    model.engine_factory = PredictEngine  # instead of loading weights
    model.load()
    asyncio.run(model.start_engine())
    assert model.serving.limits == RequestLimits(max_body_bytes=1024, max_prompts_per_request=3)


def test_too_many_prompts_per_request_is_invalid_input_naming_the_limit():
    from kserve.protocol.infer_type import InferInput, InferRequest
    from paged_runtime.entrypoints.openai.serving import RequestLimits
    engine = PredictEngine()
    model = started_model(engine, RequestLimits(max_prompts_per_request=2))
    with pytest.raises(InvalidInput, match="instances holds 3 prompts; this server takes at most 2 per request"):
        asyncio.run(model.predict({"instances": [{"prompt": [1]}] * 3}))
    texts = InferRequest("m", [InferInput("text_input", [3], "BYTES", ["a", "b", "c"])])
    with pytest.raises(InvalidInput, match="text_input holds 3 prompts; this server takes at most 2 per request"):
        asyncio.run(model.predict(texts))
    assert engine.submitted == []
    assert asyncio.run(model.predict({"instances": [{"prompt": [1]}] * 2}))["predictions"][1]["text"] == "!"


def kserve_client(model: PagedRuntimeModel, max_body_bytes: int = 2**20, keys=None) -> TestClient:
    """KServe's v1/v2 routes and error handlers over ``model``, with the OpenAI routes, the body limit and the
    key check (``keys``)."""
    from kserve.errors import invalid_input_handler
    from kserve.model_repository import ModelRepository
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.model_repository_extension import ModelRepositoryExtension
    from kserve.protocol.rest.v1_endpoints import register_v1_endpoints
    from kserve.protocol.rest.v2_endpoints import register_v2_endpoints
    from kserve_adapter.openai_routes import OpenAIRoutes, mount_openai_routes
    from kserve_adapter.server import install_access, install_body_limit
    from paged_runtime.config import ServerConfig
    from paged_runtime.entrypoints.openai.access import ApiKeys
    keys = keys or ApiKeys()
    repository = ModelRepository()
    repository.update(model)
    app = FastAPI()
    mount_openai_routes(app, OpenAIRoutes(model, api_key=keys, max_request_body_bytes=max_body_bytes))
    register_v1_endpoints(app, DataPlane(repository), ModelRepositoryExtension(repository))
    register_v2_endpoints(app, DataPlane(repository), ModelRepositoryExtension(repository))
    app.add_exception_handler(InvalidInput, invalid_input_handler)
    install_body_limit(app, max_body_bytes)
    install_access(app, keys, None, ServerConfig())
    return TestClient(app)


def test_kserve_routes_take_the_key_and_each_key_is_a_tenant():
    """Without a key v1/v2 answer 401 in KServe's shape; with two keys each one's prompts run under its own
    prefix-cache salt, the OpenAI routes' as the v1/v2 routes'."""
    from paged_runtime.entrypoints.openai.access import ApiKeys
    keys = ApiKeys(["alice", "bob"])
    engine = PredictEngine()
    client = kserve_client(started_model(engine, api_keys=keys), keys=keys)
    v1 = {"instances": [{"prompt": [1, 2], "max_tokens": 1, "cache_salt": "s"}]}
    for headers in ({}, {"Authorization": "Bearer carol"}):
        response = client.post("/v1/models/m:predict", json=v1, headers=headers)
        assert response.status_code == 401 and response.json() == {"error": response.json()["error"]}
    assert client.get("/v1/models/m").status_code == 200 and client.get("/v2/health/ready").status_code == 200
    assert engine.submitted == []
    for key in ("alice", "bob", "alice"):
        response = client.post("/v1/models/m:predict", json=v1, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
    client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "cache_salt": "s"},
                headers={"Authorization": "Bearer bob"})
    alice, bob, alice_again, bob_openai = engine.salts
    assert alice == alice_again != bob == bob_openai and alice.endswith("\0s")


def test_oversized_bodies_are_413_on_kserves_routes_and_the_openai_routes_keep_theirs():
    engine = PredictEngine()
    client = kserve_client(started_model(engine), max_body_bytes=1024)
    message = "The request body is larger than this server's limit of 1024 bytes."
    big = b'{"instances": [{"prompt": [' + b"1, " * 400 + b'1]}]}'
    for path in ("/v1/models/m:predict", "/v2/models/m/infer"):
        response = client.post(path, content=big, headers={"Content-Type": "application/json"})
        assert (response.status_code, response.json()) == (413, {"error": message}), path
        chunked = client.post(path, content=iter([big[:1000], big[1000:]]),  # no Content-Length: counted
                              headers={"Content-Type": "application/json"})
        assert (chunked.status_code, chunked.json()) == (413, {"error": message}), path
    assert engine.submitted == []
    small = client.post("/v1/models/m:predict", json={"instances": [{"prompt": [1, 2], "max_tokens": 1}]})
    assert (small.status_code, small.json()["predictions"][0]["text"]) == (200, "!")
    small = client.post("/v1/models/m:predict", content=iter([b'{"instances": ', b'[{"prompt": [1, 2]}]}']),
                        headers={"Content-Type": "application/json"})
    assert (small.status_code, small.json()["predictions"][0]["text"]) == (200, "!")
    for path in ("/openai/v1/completions", "/v1/completions"):  # the OpenAI routes' own 413 and error body
        for content in (big, iter([big[:1000], big[1000:]])):
            error = client.post(path, content=content, headers={"Content-Type": "application/json"})
            assert (error.status_code, error.json()["error"]["code"]) == (413, "request_too_large"), path
    streamed = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


# ---- huggingfaceserver's arguments (issue 17) ----------------------------------------------------
def test_huggingfaceserver_arguments_are_accepted_and_the_unused_ones_warned_about(tmp_path, caplog):
    argv = ["--model_name", "m", "--model_id", str(tmp_path), "--max_model_len", "128", "--dtype", "float32",
            "--tensor_parallel_size", "1", "--task", "text_generation", "--backend", "huggingface",
            "--trust_remote_code", "--disable_lower_case", "--disable_special_tokens", "--return_probabilities",
            "--model_revision", "main", "--disable_log_requests"]
    with caplog.at_level("WARNING", logger="kserve_adapter"):
        args = parse_args(argv)
    config = engine_config(args)
    assert (config.model, config.max_model_len, config.dtype, config.tensor_parallel_size,
            server_config(args).disable_log_requests) == (str(tmp_path), 128, "float32", 1, True)
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring huggingfaceserver arguments this runtime does not use: --model_revision, --trust_remote_code, "
        "--backend, --return_probabilities, --disable_lower_case, --disable_special_tokens"]
    assert engine_config(parse_args(["--model_name", "m", "--max_length", "64"])).max_model_len == 64


def test_huggingfaceserver_defaults_warn_about_nothing(caplog):
    with caplog.at_level("WARNING", logger="kserve_adapter"):
        parse_args(["--model_name", "m", "--backend", "auto"])
    assert caplog.records == []


@pytest.mark.parametrize("argv,message", [
    (["--task", "fill_mask"], "--task 'fill_mask' is not served: this runtime does text generation only"),
    (["--model_id", "org/model"], "--model_id 'org/model' is not a local folder: weights are never downloaded"),
])
def test_huggingfaceserver_arguments_this_runtime_cannot_serve_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model_name", "m", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_prompt_logprobs_are_refused_on_the_kserve_routes_that_cannot_return_them():
    engine = PredictEngine()
    model = started_model(engine)
    with pytest.raises(InvalidInput, match="instances\\[0\\]: prompt_logprobs are not returned by the KServe "
                                           "inference routes; use /openai/v1/completions for that"):
        asyncio.run(model.predict({"instances": [{"prompt": [1], "prompt_logprobs": 1}]}))
    assert engine.submitted == []
