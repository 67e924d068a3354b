"""The HTTP edge (issue 19): work off the event loop, body and prompt limits, bad bodies, cross-site rules.

One module-scoped engine; apps over it are built per purpose with ``build_app`` and driven in-process
through httpx's ASGI transport (``call`` runs one async scenario against an app).
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from paged_runtime.entrypoints.openai import OpenAIError, build_app

NAME = "edge"
KEY = "edge-key"
BODY_LIMIT = 256 * 1024
MAX_PROMPTS = 4
ORIGIN = "https://good.example"
JSON = {"Content-Type": "application/json"}
AUTH = {"Authorization": f"Bearer {KEY}"}
HANG_GUARD_S = 10.0


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from paged_runtime.config import EngineConfig
    from paged_runtime.engine.async_engine import AsyncEngine
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_dir), served_model_name=NAME, dtype="float32",
                                                  max_model_len=256, max_num_seqs=8, kv_cache_memory=8 * 2**20,
                                                  debug_checks=True))
    yield engine
    engine.shutdown()


def make_app(engine, **options):
    from prometheus_client import CollectorRegistry
    options = {"api_key": KEY, "max_request_body_bytes": BODY_LIMIT, "max_prompts_per_request": MAX_PROMPTS,
               "registry": CollectorRegistry(), **options}
    return build_app(engine, [NAME], **options)


@pytest.fixture(scope="module")
def app(engine):
    return make_app(engine, allowed_origins=[ORIGIN])


def call(app, scenario):
    """Runs ``scenario(client)`` (a coroutine function) against ``app`` in a fresh event loop."""
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge", timeout=HANG_GUARD_S) as client:
            return await scenario(client)

    return asyncio.run(run())


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def scenario(client):
        return await client.request(method, path, **kwargs)

    return call(app, scenario)


def post_json(app, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(app, "POST", path, content=content, headers={**JSON, **AUTH, **(headers or {})})


def assert_error(response: httpx.Response, status: int, param=None, code=None, message: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error
    if message is not None:
        assert message in error["message"], error
    return error


COMPLETION = {"model": NAME, "prompt": "Hello there", "max_tokens": 2}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
POST_ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT), ("/tokenize", {"prompt": "Hello"}),
               ("/detokenize", {"tokens": [1, 2, 3]})]


# ---- 1. tokenization and chat templates off the event loop --------------------------------------
class BlockingTokenizer:
    """The real tokenizer, except that the first encode / decode / template call waits for ``release``."""

    def __init__(self, real) -> None:
        self.real = real
        self.started, self.release = threading.Event(), threading.Event()
        self.released_in_time: bool | None = None
        self._blocked = False
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self  # the serving objects' private copy is this very stub

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __len__(self) -> int:  # special methods skip __getattr__
        return len(self.real)

    def _block_once(self) -> None:
        with self._lock:
            first, self._blocked = not self._blocked, True
        if first:
            self.started.set()
            self.released_in_time = self.release.wait(HANG_GUARD_S)

    def encode(self, *args, **kwargs):
        self._block_once()
        return self.real.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self._block_once()
        return self.real.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self._block_once()
        return self.real.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize("path,body", POST_ROUTES)
def test_health_answers_while_a_prompt_is_tokenized(engine, monkeypatch, path, body):
    """The tokenizer blocks inside the request; /health must answer meanwhile, then the request completes."""
    stub = BlockingTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", stub)
    # Also where EngineClient.process tokenized text before: on the starting code the stub then blocks
    # the event loop itself, and the test fails instead of passing vacuously.
    monkeypatch.setattr(engine._processor, "tokenizer", stub)
    app = make_app(engine)

    async def scenario(client):
        work = asyncio.create_task(client.post(path, json=body, headers=AUTH))
        assert await asyncio.to_thread(stub.started.wait, HANG_GUARD_S)
        health = await client.get("/health")
        blocked_meanwhile = not work.done()
        stub.release.set()
        return health, blocked_meanwhile, await work

    health, blocked_meanwhile, response = call(app, scenario)
    assert stub.released_in_time, "the event loop stood still while the tokenizer worked"
    assert health.status_code == 200 and blocked_meanwhile
    assert response.status_code == 200, response.text


# ---- 2. body and prompt limits ---------------------------------------------------------------------
def test_declared_body_over_the_limit_is_413(app):
    body = json.dumps({**COMPLETION, "prompt": "x" * BODY_LIMIT}).encode()
    assert_error(post_json(app, "/v1/completions", body), 413, code="request_too_large",
                 message=f"limit of {BODY_LIMIT} bytes")
    assert post_json(app, "/v1/completions", {**COMPLETION, "prompt": "x" * 100}).status_code == 200


def test_chunked_body_is_refused_without_reading_past_the_limit(app):
    chunk, pulled = b" " * 16384, []

    async def endless():
        yield b'{"prompt": "'
        while len(pulled) < 10_000:  # far beyond the limit if the server kept reading
            pulled.append(len(chunk))
            yield chunk

    async def scenario(client):
        return await client.post("/v1/completions", content=endless(), headers={**JSON, **AUTH})

    response = call(app, scenario)
    assert "content-length" not in {k.lower() for k in response.request.headers}
    assert_error(response, 413, code="request_too_large")
    assert sum(pulled) <= BODY_LIMIT + len(chunk)


def test_real_server_refuses_an_oversized_body_and_keeps_serving(tiny_server):
    """Through uvicorn, with the default limit (16 MiB): a 413 before the body is parsed or tokenized."""
    body = json.dumps({"prompt": "x" * (16 * 2**20)}).encode()
    response = httpx.post(f"{tiny_server.url}/v1/completions", content=body, headers=JSON, timeout=60)
    assert_error(response, 413, code="request_too_large", message=f"limit of {16 * 2**20} bytes")
    assert httpx.get(f"{tiny_server.url}/health", timeout=60).status_code == 200
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_prompts_per_request_are_capped(app):
    response = post_json(app, "/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c", "d", "e"]})
    assert_error(response, 400, param="prompt", message=f"at most {MAX_PROMPTS} per request")
    response = post_json(app, "/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c", "d"]})
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_PROMPTS


# ---- 3. bodies that used to be a 500 ----------------------------------------------------------------
SURROGATE, LOW_SURROGATE = "\\ud800", "\\udfff"  # JSON's escapes for lone UTF-16 surrogates
PAIR = "\\ud83d\\ude00"  # a surrogate pair: valid JSON for U+1F600


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", f'{{"model": "{SURROGATE}", "prompt": "hi"}}', "model"),
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": "a{SURROGATE}b"}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "{SURROGATE}"]}}', "prompt[1]"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": ["{SURROGATE}"]}}', "stop[0]"),
    ("/v1/completions", f'{{"prompt": "hi", "user": "{SURROGATE}"}}', "user"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     "messages[0].content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", '
                             f'"text": "{LOW_SURROGATE}"}}]}}]}}', "messages[0].content[0].text"),
    ("/v1/chat/completions", f'{{"messages": [], "chat_template_kwargs": {{"{SURROGATE}": 1}}}}',
     "chat_template_kwargs"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
])
def test_lone_surrogate_anywhere_is_a_400(app, path, raw, param):
    error = assert_error(post_json(app, path, raw.encode()), 400, param=param, code="invalid_unicode")
    assert "lone UTF-16 surrogate" in error["message"]
    paired = post_json(app, path, raw.replace(SURROGATE, PAIR).replace(LOW_SURROGATE, PAIR).encode())
    assert paired.status_code != 500 and "invalid_unicode" not in paired.text  # a pair is fine


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"prompt": ' + b"[" * 65 + b"]" * 65 + b"}",
                                 b'{"prompt": "hi", "chat_template_kwargs": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001])
def test_deep_nesting_is_a_400(app, raw):
    assert_error(post_json(app, "/v1/chat/completions", raw), 400, code="invalid_json", message="nests deeper than")


def test_an_error_quoting_client_text_is_always_encodable():
    response = OpenAIError(404, "The model `\ud800` does not exist.", param="m\udc00").response()
    error = json.loads(response.body)["error"]
    assert (error["message"], error["param"]) == ("The model `\\ud800` does not exist.", "m\\udc00")


# ---- 4. cross-site -------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", POST_ROUTES)
def test_post_routes_require_json_content_type(app, path, body):
    """A "simple" cross-origin request (no preflight) cannot carry application/json: such bodies get 415."""
    for content_type in [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/jsonx"]:
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        response = request(app, "POST", path, content=json.dumps(body).encode(), headers=headers)
        assert_error(response, 415, code="unsupported_media_type", message="must be application/json")
    for content_type in ["application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"]:
        response = request(app, "POST", path, content=json.dumps(body).encode(),
                           headers={**AUTH, "Content-Type": content_type})
        assert response.status_code == 200, (content_type, response.text)


def test_cors_only_for_the_allowed_origins(app, engine):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = request(app, "OPTIONS", "/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = request(app, "OPTIONS", "/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = request(app, "GET", "/version", headers={"Origin": "https://evil.example"})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers

    no_cors = make_app(engine)
    refused = request(no_cors, "OPTIONS", "/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert refused.status_code == 405 and "access-control-allow-origin" not in refused.headers
    simple = request(no_cors, "GET", "/version", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in simple.headers


@pytest.mark.parametrize("path,body", POST_ROUTES[2:])
def test_tokenize_and_detokenize_need_the_key(app, path, body):
    response = request(app, "POST", path, json=body)
    assert_error(response, 401, code="invalid_api_key", message="Missing API key")
    assert request(app, "POST", path, json=body, headers=AUTH).status_code == 200


def test_metrics_open_unless_the_flag_puts_it_behind_the_key(app, engine):
    for path in ("/health", "/version", "/metrics"):
        assert request(app, "GET", path).status_code == 200, path
    guarded = make_app(engine, metrics_require_api_key=True)
    assert_error(request(guarded, "GET", "/metrics"), 401, code="invalid_api_key")
    assert request(guarded, "GET", "/metrics", headers=AUTH).status_code == 200
    for path in ("/health", "/version"):
        assert request(guarded, "GET", path).status_code == 200, path


def test_cli_flags_for_the_edge():
    from paged_runtime.entrypoints.cli import build_parser, server_config
    args = server_config(build_parser().parse_args(["serve"]))
    assert (args.max_request_body_bytes, args.max_prompts_per_request, args.allowed_origins,
            args.metrics_require_api_key) == (16 * 2**20, 256, None, False)
    args = server_config(build_parser().parse_args([
        "serve", "--max-request-body-bytes", "1MiB", "--max-prompts-per-request", "8", "--allowed-origins", ORIGIN,
        "http://localhost:3000", "--metrics-require-api-key"]))
    assert (args.max_request_body_bytes, args.max_prompts_per_request, args.allowed_origins,
            args.metrics_require_api_key) == (2**20, 8, [ORIGIN, "http://localhost:3000"], True)


# ---- a text too long to be a prompt is refused before it is tokenized ------------------------------
@pytest.mark.parametrize("path, field, param", [("/v1/completions", "prompt", "prompt"),
                                                ("/v1/chat/completions", "messages", "messages"),
                                                ("/tokenize", "prompt", "prompt")])
def test_a_text_longer_than_any_prompt_that_fits_is_a_400_without_tokenizing(app, engine, monkeypatch, path,
                                                                             field, param):
    """More characters than max_model_len tokens of the longest token text can hold: refused at once, so a
    huge prompt (under the body limit) cannot hold the route's tokenizer thread, and everyone behind it."""
    from paged_runtime.engine.processor import max_prompt_chars
    limit = max_prompt_chars(engine.tokenizer, engine.max_model_len)
    text = "a" * (limit + 1)
    encoded = []
    tokenizer_class = type(engine.tokenizer)
    real_encode = tokenizer_class.encode
    monkeypatch.setattr(tokenizer_class, "encode",
                        lambda self, t, *a, **k: encoded.append(len(t)) or real_encode(self, t, *a, **k))
    body = {"model": NAME, "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": text}]} if field == "messages" else {"prompt": text})
    error = assert_error(post_json(app, path, body), 400, param, "context_length_exceeded")
    assert f"{limit} characters at most" in error["message"]
    assert all(n <= limit for n in encoded)  # the long text itself was never tokenized

