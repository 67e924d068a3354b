"""POST /v1/embeddings through the openai SDK on a --runner pooling server (the tiny random Llama, float32):
each input kind, base64, dimensions, usage, and the 4xx cases; vectors equal the offline ``LLM.embed``'s."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import make_llm
from tests.server.conftest import running_server
from paged_runtime.pooling_params import PoolingParams

NAME = "tiny-embed"
TEXTS = ["The lighthouse keeper counted the ships.", "A short one.", "Fog rolled over the harbour at dawn again."]


@pytest.fixture(scope="module")
def embed_server(tiny_llama_dir):
    with running_server(tiny_llama_dir, NAME, runner="pooling", max_model_len=128,
                        kv_cache_memory=8 * 2**20, app_options={"max_prompts_per_request": 4}) as server:
        yield server


@pytest.fixture(scope="module")
def client(embed_server):
    return openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return make_llm(tiny_llama_dir, runner="pooling", max_model_len=128)


def vectors(reference, inputs, **pooling):
    params = PoolingParams(**pooling) if pooling else None
    return [o.outputs.embedding for o in reference.embed(inputs, use_tqdm=False, pooling_params=params)]


def test_each_input_kind_matches_the_offline_embeddings(client, reference, embed_server):
    tokenizer = reference.get_tokenizer()
    ids = [tokenizer.encode(t) for t in TEXTS]
    expected = vectors(reference, [{"prompt_token_ids": i} for i in ids])
    for given, want in ((TEXTS[0], expected[:1]), (TEXTS, expected), (ids[1], expected[1:2]), (ids, expected)):
        response = client.embeddings.create(model=NAME, input=given)
        assert response.object == "list" and response.model == NAME
        assert [d.index for d in response.data] == list(range(len(want)))
        assert all(d.object == "embedding" and len(d.embedding) == 64 for d in response.data)
        np.testing.assert_allclose([d.embedding for d in response.data], want, atol=1e-5, rtol=0)
        num_tokens = sum(len(i) for i in (ids if len(want) == 3 else [ids[0] if given == TEXTS[0] else ids[1]]))
        assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    embed_server.wait_idle()


def test_base64_is_little_endian_float32(client, reference, embed_server):
    raw = httpx.post(f"{embed_server.url}/v1/embeddings",
                     json={"model": NAME, "input": TEXTS[:2], "encoding_format": "base64"}, timeout=60).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_allclose(decoded, vectors(reference, TEXTS[:2]), atol=1e-5, rtol=0)
    # Asked for explicitly, the SDK hands the strings over as they came (unasked, it asks for base64 itself and
    # decodes: test_each_input_kind_matches_the_offline_embeddings goes that way).
    sdk = client.embeddings.create(model=NAME, input=TEXTS[:2], encoding_format="base64")
    assert [d.embedding for d in sdk.data] == [d["embedding"] for d in raw["data"]]


def test_dimensions_truncate_then_renormalise(client, reference):
    response = client.embeddings.create(model=NAME, input=TEXTS[2], dimensions=8, encoding_format="float")
    vector = response.data[0].embedding
    assert len(vector) == 8 and abs(np.linalg.norm(vector) - 1) < 1e-5
    np.testing.assert_allclose(vector, vectors(reference, [TEXTS[2]], dimensions=8)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": ["a", "b", "c", "d", "e"]}, "input"),
    ({"input": [[1, 2], [3, 10**9]]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_requests_are_400_naming_the_field(embed_server, body, param):
    response = httpx.post(f"{embed_server.url}/v1/embeddings", json={"model": NAME, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    embed_server.wait_idle()


def test_unknown_model_is_404(embed_server):
    response = httpx.post(f"{embed_server.url}/v1/embeddings", json={"model": "nope", "input": "hi"}, timeout=60)
    assert response.status_code == 404


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
])
def test_generation_routes_on_a_pooling_server_are_400_naming_the_route(embed_server, route, body):
    response = httpx.post(f"{embed_server.url}{route}", json={"model": NAME, **body}, timeout=60)
    assert response.status_code == 400
    assert route in response.json()["error"]["message"]


def test_embeddings_on_a_generative_server_is_400(tiny_server):
    response = httpx.post(f"{tiny_server.url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert response.status_code == 400
    assert "/v1/embeddings" in response.json()["error"]["message"]
