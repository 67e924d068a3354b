"""Who may call the server (issue 34, item 7): Host checks against DNS rebinding, several API keys as tenants with
prefix caches of their own, ``cached_tokens`` only when asked for, and the render routes behind the same checks.

One module-scoped engine; apps over it are built per case with ``app_options`` (as ``serve`` builds them from its
settings) and driven in-process through httpx's ASGI transport.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from paged_runtime.config import ServerConfig
from paged_runtime.entrypoints.openai import app_options, build_app
from paged_runtime.entrypoints.openai.access import ApiKeys, host_name, is_loopback, trusted_hosts

NAME = "access"
JSON = {"Content-Type": "application/json"}
PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp, and " * 3  # several full blocks


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from paged_runtime.config import EngineConfig
    from paged_runtime.engine.async_engine import AsyncEngine
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_dir), served_model_name=NAME, dtype="float32",
                                                  max_model_len=256, max_num_seqs=4, kv_cache_memory=8 * 2**20,
                                                  block_size=16, debug_checks=True))
    yield engine
    engine.shutdown()


def app_for(engine, bind_host: str = "127.0.0.1", **settings):
    from prometheus_client import CollectorRegistry
    options = app_options(ServerConfig(**settings), bind_host=bind_host)
    return build_app(engine, [NAME], registry=CollectorRegistry(), **options)


def send(app, method: str, path: str, host: str = "127.0.0.1:8000", key: str | None = None,
         **kwargs) -> httpx.Response:
    headers = {"Host": host, **JSON, **({"Authorization": f"Bearer {key}"} if key else {})}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server",
                                     timeout=60) as client:
            return await client.request(method, path, headers=headers, **kwargs)

    return asyncio.run(run())


# ---- Host --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,loopback", [
    ("localhost", True), ("LOCALHOST.", True), ("app.localhost", True), ("127.0.0.1", True), ("127.8.9.10", True),
    ("::1", True), ("[::1]", True), ("evil.example", False), ("localhost.evil.example", False), ("10.0.0.1", False),
    ("0.0.0.0", False), ("", False),
])
def test_loopback_names(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("header,name", [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
                                         ("example.com", "example.com"), ("::1", "::1")])
def test_host_name_drops_the_port(header, name):
    assert host_name(header) == name


def test_when_the_host_is_checked():
    none, one = ApiKeys(), ApiKeys("k")
    assert trusted_hosts("127.0.0.1", none, None) == []  # loopback names only
    assert trusted_hosts("localhost", none, None) == []
    assert trusted_hosts("0.0.0.0", none, None) is None  # bound beyond loopback: any Host
    assert trusted_hosts("127.0.0.1", one, None) is None  # a key guards it instead
    assert trusted_hosts(None, none, None) is None  # bind address unknown (Ray Serve's proxy)
    assert trusted_hosts("0.0.0.0", one, ["Api.Internal"]) == ["api.internal"]  # given: holds everywhere
    assert trusted_hosts("127.0.0.1", none, ["*"]) is None


def test_a_loopback_server_without_a_key_refuses_foreign_hosts(engine):
    app = app_for(engine)
    for path in ("/health", "/v1/models"):
        response = send(app, "GET", path, host="attacker.example:8000")
        assert response.status_code == 403, path
        error = response.json()["error"]
        assert error["code"] == "host_not_allowed" and "attacker.example" in error["message"]
    response = send(app, "POST", "/v1/completions", host="attacker.example", json={"prompt": "hi", "max_tokens": 1})
    assert response.status_code == 403
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "localhost"):
        assert send(app, "GET", "/v1/models", host=host).status_code == 200, host


def test_allowed_hosts_widen_it_and_a_key_or_a_public_bind_lifts_it(engine):
    widened = app_for(engine, allowed_hosts=["llm.internal"])
    assert send(widened, "GET", "/v1/models", host="llm.internal:8000").status_code == 200
    assert send(widened, "GET", "/v1/models", host="other.internal").status_code == 403
    assert send(app_for(engine, api_key=["k"]), "GET", "/health", host="any.example").status_code == 200
    assert send(app_for(engine, bind_host="0.0.0.0"), "GET", "/health", host="any.example").status_code == 200
    assert send(app_for(engine, allowed_hosts=["*"]), "GET", "/health", host="any.example").status_code == 200


# ---- keys and tenants ---------------------------------------------------------------------------------------
def test_several_keys_each_open_the_routes(engine, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nk3\n\n")
    app = app_for(engine, api_key=["k1", "k2"], api_keys_file=str(keys_file))
    for key in ("k1", "k2", "k3"):
        assert send(app, "GET", "/v1/models", key=key).status_code == 200, key
    for key in (None, "k4", "k1k2"):
        response = send(app, "GET", "/v1/models", key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def cached_tokens(app, key: str | None = None, **body) -> int:
    response = send(app, "POST", "/v1/completions", key=key,
                    json={"model": NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_never_hit_each_others_prefix_cache(engine):
    """Two keys: the second key's identical prompt finds nothing cached; its own repeat does."""
    engine.reset_prefix_cache()
    app = app_for(engine, api_key=["alice", "bob"], enable_prompt_tokens_details=True)
    assert cached_tokens(app, "alice") == 0
    assert cached_tokens(app, "alice") > 0  # the tenant's own blocks are found
    assert cached_tokens(app, "bob") == 0  # not alice's
    assert cached_tokens(app, "bob", cache_salt="x") == 0
    assert cached_tokens(app, "bob", cache_salt="x") > 0


def test_sharing_across_keys_can_be_turned_back_on(engine):
    engine.reset_prefix_cache()
    app = app_for(engine, api_key=["alice", "bob"], share_prefix_cache_across_keys=True,
                  enable_prompt_tokens_details=True)
    assert cached_tokens(app, "alice") == 0
    assert cached_tokens(app, "bob") > 0


def test_cached_tokens_are_reported_only_when_enabled(engine):
    """By default usage has no prompt_tokens_details: one caller cannot learn what another sent."""
    engine.reset_prefix_cache()
    app = app_for(engine)
    for _ in range(2):
        response = send(app, "POST", "/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 1})
        assert response.status_code == 200 and "prompt_tokens_details" not in response.json()["usage"]
    response = send(app, "POST", "/v1/chat/completions",
                    json={"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1})
    assert response.status_code == 200 and "prompt_tokens_details" not in response.json()["usage"]
    assert cached_tokens(app_for(engine, enable_prompt_tokens_details=True)) > 0


# ---- render --------------------------------------------------------------------------------------------------
def test_render_gives_the_exact_prompt_ids_the_generate_routes_use(engine):
    app = app_for(engine, api_key=["k"])
    tokenizer = engine.tokenizer
    rendered = send(app, "POST", "/v1/completions/render", key="k",
                    json={"model": NAME, "prompt": ["one two", "three"], "max_tokens": 4, "temperature": 0})
    assert rendered.status_code == 200, rendered.text
    first, second = rendered.json()
    assert first["token_ids"] == tokenizer.encode("one two") and second["token_ids"] == tokenizer.encode("three")
    ids = send(app, "POST", "/v1/completions/render", key="k", json={"prompt": [5, 6, 7]}).json()
    assert [r["token_ids"] for r in ids] == [[5, 6, 7]]
    assert first["request_id"].startswith("cmpl-") and first["model"] == NAME and first["features"] is None
    assert first["sampling_params"]["max_tokens"] == 4 and first["sampling_params"]["temperature"] == 0
    assert (first["stream"], first["cache_salt"], first["priority"]) == (False, None, 0)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = send(app, "POST", "/v1/chat/completions/render", key="k", json={"model": NAME, "messages": messages})
    tokenized = send(app, "POST", "/tokenize", key="k", json={"model": NAME, "messages": messages})
    assert chat.status_code == 200 and chat.json()["token_ids"] == tokenized.json()["tokens"]
    assert chat.json()["request_id"].startswith("chatcmpl-")
    assert engine.num_unfinished_requests == 0  # nothing was generated


def test_render_routes_check_like_the_generate_routes(engine):
    app = app_for(engine, api_key=["k"])
    assert send(app, "POST", "/v1/completions/render", json={"prompt": "x"}).status_code == 401
    response = send(app, "POST", "/v1/completions/render", key="k", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = send(app, "POST", "/v1/completions/render", key="k", json={"prompt": "x " * 400, "max_tokens": 4})
    assert response.status_code == 400 and "max_model_len is 256" in response.json()["error"]["message"]
    response = send(app, "POST", "/v1/chat/completions/render", key="k", json={"messages": "hello"})
    assert response.status_code == 400
    assert send(app, "POST", "/v1/completions/render", key="k", content=b'{"prompt": "\\ud800"}').status_code == 400


def test_render_shows_the_tenants_salt_when_keys_separate_tenants(engine):
    app = app_for(engine, api_key=["alice", "bob"])
    salts = [send(app, "POST", "/v1/completions/render", key=key, json={"prompt": "x", "cache_salt": "s"}).json()[0][
        "cache_salt"] for key in ("alice", "bob")]
    assert salts[0] != salts[1] and all(s.startswith("tenant:") and s.endswith("\0s") for s in salts)
