"""LoRA adapters on a real local Ray cluster (one Serve application for this module; tiny Llama, CPU).

The application is ``rayserve_adapter:app`` with two model replicas behind the ingress (KV-event routing, the
default), ``enable_lora`` and a ``dynamic_lora_loading_path`` holding two peft adapters, each loaded by a replica
on its first request for it: a request naming an adapter (alone, or as ``base:adapter``) gets peft's greedy
text, ``/v1/models`` lists it, an unknown adapter is the replica's 404, and the requests for one adapter stay
on the replica that loaded it (its ``record_routing_stats`` report it; the other's do not).
"""
from __future__ import annotations


import httpx
import pytest

from tests.helpers.lora import ADAPTERS, make_adapters, peft_greedy
from tests.helpers.ray_serve import serve_on_loopback

pytestmark = [pytest.mark.ray]

pytest.importorskip("ray.serve")

NAME = "tiny"
APP = "lora"
PROMPT_IDS = [1, 504, 3012, 7891, 42, 17, 9000, 4518]
USED = ("sql", "mlp")  # the adapters in the dynamic folder


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-adapters")
    make_adapters(tiny_llama_dir, root, {name: ADAPTERS[name] for name in USED})
    return root


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, adapter_dir):
    """peft's greedy text of each adapter (None: the base model's)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = {name: tokenizer.decode(peft_greedy(tiny_llama_dir, adapter_dir / name if name else None,
                                                [PROMPT_IDS], 8)[0]) for name in (*USED, None)}
    assert len(set(texts.values())) == 3  # the test can tell them apart
    return texts


@pytest.fixture(scope="module")
def url(tiny_llama_dir, adapter_dir):
    from ray import serve

    from rayserve_adapter import app
    with serve_on_loopback() as port:
        serve.run(app({"model": str(tiny_llama_dir), "served_model_name": NAME, "dtype": "float32",
                       "max_model_len": 256, "kv_cache_memory": 8 * 2**20, "max_num_seqs": 2, "num_cpus": 0,
                       "num_replicas": 2, "routing_stats_period_s": 0.5, "debug_checks": True,
                       "shutdown_timeout": 1, "enable_lora": True, "max_loras": 2,
                       "dynamic_lora_loading_path": str(adapter_dir)}),
                  name=APP, route_prefix=f"/{APP}")  # returns once the replicas are up
        yield f"http://127.0.0.1:{port}/{APP}"


def complete(url: str, model: str, prompt: list[int] | str = PROMPT_IDS) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def held_by_replica() -> dict[str, list[str]]:
    """Each model replica's ``lora_adapters`` routing stat, by replica actor name (asked of the actors)."""
    import ray
    prefix = f"SERVE_REPLICA::{APP}#PagedRuntimeServer#"
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))
    assert len(names) == 2
    return {name: ray.get(ray.get_actor(name, namespace="serve").record_routing_stats.remote(),
                          timeout=30)["lora_adapters"] for name in names}


def test_an_adapter_by_name_or_as_base_colon_adapter_runs_peft_greedy(url, oracle):
    assert text(complete(url, "sql")) == oracle["sql"]
    assert text(complete(url, f"{NAME}:mlp")) == oracle["mlp"]
    assert text(complete(url, NAME)) == oracle[None]
    assert text(complete(url, f"{NAME}:sql")) == oracle["sql"]


def test_requests_for_an_adapter_stay_on_the_replica_that_loaded_it(url):
    """Fresh prompts alone would spread over both replicas (the router sends a new prefix to the emptier);
    the adapter keeps them on its holder."""
    for i in range(6):
        prompt = f"{i} is the number of this request; the adapter decides where it runs, not the prompt."
        assert complete(url, "sql", prompt).status_code == 200
    holders = [name for name, held in held_by_replica().items() if "sql" in held]
    assert len(holders) == 1, held_by_replica()


def test_models_list_the_adapters_with_their_base(url):
    assert complete(url, "mlp").status_code == 200
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert data[0]["id"] == NAME and set(by_id) == {NAME, *USED}
    assert by_id["mlp"]["parent"] == NAME and by_id["mlp"]["root"].endswith("mlp")
    assert any("mlp" in held for held in held_by_replica().values())


@pytest.mark.parametrize("model", ["nope", f"{NAME}:nope"])
def test_an_unknown_adapter_is_a_404_from_the_replica(url, model):
    response = complete(url, model)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found" and "nope" in response.json()["error"]["message"]
