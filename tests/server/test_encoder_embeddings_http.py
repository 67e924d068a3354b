"""POST /v1/embeddings on an encoder (the tiny random BertModel, started with the default --runner auto, which
pools it): texts and token ids give the offline ``LLM.embed`` vectors; the generation routes are 400s."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import make_llm
from tests.server.conftest import running_server

NAME = "tiny-bert"
TEXTS = ["The lighthouse keeper counted the ships.", "Fog over the harbour.", "a"]


@pytest.fixture(scope="module")
def bert_server(tiny_bert_dir):
    with running_server(tiny_bert_dir, NAME) as server:
        yield server


def test_embeddings_match_the_offline_vectors(bert_server, tiny_bert_dir):
    reference = make_llm(tiny_bert_dir)
    ids = [reference.get_tokenizer().encode(t) for t in TEXTS]
    expected = [o.outputs.embedding for o in reference.embed(TEXTS, use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{bert_server.url}/v1", api_key="unused", max_retries=0)
    for given in (TEXTS, ids):
        response = client.embeddings.create(model=NAME, input=given, encoding_format="float")
        assert [d.index for d in response.data] == [0, 1, 2]
        np.testing.assert_allclose([d.embedding for d in response.data], expected, atol=1e-5, rtol=0)
        assert response.usage.prompt_tokens == sum(len(i) for i in ids)  # [CLS] and [SEP] counted
    bert_server.wait_idle()


def test_completions_on_an_encoder_is_a_400_naming_the_route(bert_server):
    response = httpx.post(f"{bert_server.url}/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unsupported_model" and "/v1/completions" in error["message"]
