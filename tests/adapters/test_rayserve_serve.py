"""rayserve_adapter on a real local Ray cluster (one for this module), tiny random Llama, CPU.

One Serve instance on 127.0.0.1 (a free port) runs two applications built by ``rayserve_adapter:app``:

- ``single`` (/single): one ``PagedRuntimeServer`` replica serving the OpenAI routes itself;
- ``multi`` (/multi): ``PagedRuntimeIngress`` over two ``PagedRuntimeServer`` replicas, routed prefix-aware;
- ``two`` (/two): two models (``models=[alpha, beta]``), a model deployment each behind one ingress, with a key.

Both have ``max_num_seqs`` 2 (so ``max_ongoing_requests`` 2 per replica) and ``max_queued_requests`` 1.
Replica-side counts come from each replica itself: its /metrics (single) or its ``record_routing_stats``
(every replica of ``multi``, called on the replica actors directly).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.helpers.ray_serve import serve_on_loopback

pytestmark = [pytest.mark.ray]

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

NAME = "tiny"
MAX_NUM_SEQS = 2
RETRY_AFTER_S = 3
BLOCK_SIZE = 16
MODES = ["single", "multi"]
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
LONG = {"max_tokens": 1000, "ignore_eos": True, "stream": True}  # seconds of decoding: held until we hang up
SHUTDOWN_TIMEOUT = 1  # Serve's graceful_shutdown_timeout_s for the model replicas
API_KEY = "two-models-key"


@dataclass
class Stats:
    kv_cache_usage: float
    num_running: int
    num_aborted: int


@dataclass
class Cluster:
    url: str

    def replica_stats(self, app_name: str) -> dict[str, dict]:
        """record_routing_stats of every model replica of ``app_name``, by replica actor name."""
        import ray
        prefix = f"SERVE_REPLICA::{app_name}#PagedRuntimeServer#"
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(prefix))
        return {name: ray.get(ray.get_actor(name, namespace="serve").record_routing_stats.remote(), timeout=30)
                for name in names}

    def metrics(self, app_name: str) -> dict[tuple[str, tuple], float]:
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{self.url}/{app_name}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stats(self, mode: str) -> Stats:
        """single: the replica's /metrics (vLLM's names); multi: summed over both replicas' own stats."""
        if mode == "single":
            m = self.metrics("single")
            label = (("model_name", NAME),)
            return Stats(m[("vllm:kv_cache_usage_perc", label)], int(m[("vllm:num_requests_running", label)]),
                         int(m.get(("vllm:request_success_total", (("finished_reason", "abort"),) + label), 0)))
        replicas = self.replica_stats(mode).values()
        return Stats(sum(r["kv_cache_usage"] for r in replicas), sum(r["num_running"] for r in replicas),
                     sum(r["num_aborted_requests"] for r in replicas))

    def wait_for(self, mode: str, predicate, what: str, timeout: float = 60.0) -> Stats:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats(mode)
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"{mode}: {what} not reached in {timeout}s: {stats}")
            time.sleep(0.05)

    def wait_idle(self, mode: str) -> Stats:
        return self.wait_for(mode, lambda s: s.kv_cache_usage == 0 and s.num_running == 0, "idle")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, two_models_dir):
    from ray import serve

    from rayserve_adapter import app
    with serve_on_loopback() as port:
        common = {"model": str(tiny_llama_dir), "served_model_name": NAME, "dtype": "float32", "max_model_len": 1024,
                  "kv_cache_memory": 16 * 2**20, "max_num_seqs": MAX_NUM_SEQS, "num_cpus": 0,
                  "max_queued_requests": 1, "retry_after_s": RETRY_AFTER_S, "routing_stats_period_s": 0.5,
                  "debug_checks": True, "shutdown_timeout": SHUTDOWN_TIMEOUT}
        serve.run(app(common), name="single", route_prefix="/single")  # returns once the replicas are up
        serve.run(app({**common, "num_replicas": 2}), name="multi", route_prefix="/multi")
        models = [str(two_models_dir / "alpha"), str(two_models_dir / "beta")]
        two = {k: v for k, v in common.items() if k not in ("model", "served_model_name")}
        serve.run(app({**two, "models": models, "api_key": API_KEY}), name="two", route_prefix="/two")
        yield Cluster(f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The offline API on the same weights: what greedy decoding must produce."""
    from tests.conftest import make_llm
    return make_llm(tiny_llama_dir, max_model_len=1024, kv_cache_memory=16 * 2**20)


# ---- the OpenAI routes through Serve -------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_openai_sdk_completions_and_chat(cluster, reference, mode):
    from paged_runtime import SamplingParams
    client = openai.OpenAI(base_url=f"{cluster.url}/{mode}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [NAME]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    params = {"model": NAME, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}

    expected = reference.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    whole = client.completions.create(prompt=PROMPT, **params)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                            **params))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 8

    expected_chat = reference.chat(MESSAGES, greedy, use_tqdm=False)[0].outputs[0].text
    reply = client.chat.completions.create(messages=MESSAGES, **params)
    assert reply.choices[0].message.content == expected_chat and reply.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **params))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_chat
    assert chunks[-1].choices[0].finish_reason == "length"

    with pytest.raises(openai.BadRequestError) as bad:  # the runtime's own 4xx bodies come through
        client.completions.create(prompt=PROMPT, model=NAME, max_tokens=2000)
    assert bad.value.body["code"] == "context_length_exceeded"
    assert httpx.get(f"{cluster.url}/{mode}/health", timeout=30).status_code == 200


def test_two_models_in_one_application_each_answer_by_name(cluster, two_models_dir):
    from tests.conftest import make_llm
    from paged_runtime import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = {name: make_llm(two_models_dir / name, max_model_len=1024, kv_cache_memory=16 * 2**20)
                .generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text for name in ("alpha", "beta")}
    assert expected["alpha"] != expected["beta"]
    client = openai.OpenAI(base_url=f"{cluster.url}/two/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
    for name, text in expected.items():
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.model == name and reply.choices[0].text == text
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
    assert missing.value.body["code"] == "model_not_found" and str(two_models_dir) not in str(missing.value.body)
    no_model = httpx.post(f"{cluster.url}/two/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    for body in ({"model": "gamma", "prompt": PROMPT}, {"prompt": PROMPT}):  # no key: 401 before anything else
        assert httpx.post(f"{cluster.url}/two/v1/completions", json=body, timeout=30).status_code == 401
    assert httpx.get(f"{cluster.url}/two/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{cluster.url}/two/health", timeout=30).status_code == 200


# ---- prefix-aware routing (runs before the tests that leave stale queue lengths in the ingress's router) ---
PREFIXES = [
    "You are the support assistant of a bicycle repair shop. Answer politely, mention opening hours "
    "(nine to six, Monday to Saturday) when relevant, never promise a repair date, and suggest booking "
    "an inspection for anything involving brakes, forks or carbon frames. Customer question: ",
    "Summarise the following incident report for the on-call engineer in exactly three bullet points, "
    "each under twenty words, naming the affected service, the first alert time and the mitigation. "
    "Keep technical terms as written and do not speculate about root causes. Report: ",
    "Translate the following product description from English into plain, friendly Spanish suitable "
    "for a catalogue aimed at families; keep measurements in centimetres, keep brand names unchanged "
    "and avoid regional slang so that readers in every country understand it. Text: ",
    "Classify the sentiment of the following restaurant review as positive, negative or mixed, then "
    "quote the single sentence that best supports your label; if the review mentions hygiene, flag it "
    "for the quality team with the word FLAG on its own line at the end. Review: ",
]
NUM_REQUESTS_PER_PREFIX = 8


def prompts_of(prefix: str) -> list[str]:
    return [f"{prefix}item {i} of the list, number {i * 7}?" for i in range(NUM_REQUESTS_PER_PREFIX)]


def expected_hits(cluster: Cluster, prompts: list[str]) -> int:
    """Prefix-cache hits if every prompt lands on one replica, in order: each prompt's full blocks shared
    with an earlier prompt (block-aligned longest common prefix of token ids)."""
    token_ids = [httpx.post(f"{cluster.url}/multi/tokenize", json={"model": NAME, "prompt": p}, timeout=30)
                 .json()["tokens"] for p in prompts]
    total = 0
    for i, ids in enumerate(token_ids[1:], start=1):
        common = max(_common_prefix(ids, earlier) for earlier in token_ids[:i])
        total += min(common, len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always computed
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def stats_delta(before: dict[str, dict], after: dict[str, dict], key: str) -> dict[str, int]:
    return {name: after[name][key] - before[name][key] for name in after}


def test_prefix_aware_routing_keeps_prefixes_together_and_beats_random(cluster):
    from ray import serve

    from rayserve_adapter.asgi import ForwardedRequest
    cluster.wait_idle("multi")
    owners, aware_hits, best_hits = [], 0, []
    with httpx.Client(base_url=f"{cluster.url}/multi", timeout=60) as client:
        for prefix in PREFIXES[:2]:
            prompts = prompts_of(prefix)
            before = cluster.replica_stats("multi")
            for prompt in prompts:
                response = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 1})
                assert response.status_code == 200, response.text
            after = cluster.replica_stats("multi")
            queries = stats_delta(before, after, "num_prefix_queries")
            served = [name for name, n in queries.items() if n]
            assert len(served) == 1, f"one prefix, several replicas: {queries}"  # every request on one replica
            num_prompt_tokens = sum(len(client.post("/tokenize", json={"prompt": p}).json()["tokens"]) for p in prompts)
            assert queries[served[0]] == num_prompt_tokens
            owners.append(served[0])
            hits = sum(stats_delta(before, after, "num_prefix_hits").values())
            assert hits == expected_hits(cluster, prompts)  # every repeat found the prefix in the cache
            aware_hits += hits
    assert owners[0] != owners[1]  # a fresh prefix went to the replica that held none

    # The same kind of traffic without a routing key: Serve's power of two choices, random between idle replicas.
    handle = serve.get_deployment_handle("PagedRuntimeServer", app_name="multi").options(stream=True)
    before = cluster.replica_stats("multi")
    for prefix in PREFIXES[2:]:
        prompts = prompts_of(prefix)
        best_hits.append(expected_hits(cluster, prompts))
        for prompt in prompts:
            body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 1}).encode()
            parts = list(handle.forward.remote(ForwardedRequest("POST", "/v1/completions", b"",
                                                                ((b"content-type", b"application/json"),), body)))
            assert parts[0].status == 200
    random_hits = sum(stats_delta(before, cluster.replica_stats("multi"), "num_prefix_hits").values())
    # Random placement pays one miss per replica a prefix visits: fewer hits than affinity's best (equal only
    # if all 8 requests of both prefixes happened to pick one replica each: p = (2 / 2**8) ** 2 ~ 6e-5).
    assert random_hits < sum(best_hits)
    assert aware_hits > random_hits


# ---- disconnects and backpressure ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_client_disconnect_aborts_and_frees_kv(cluster, mode):
    before = cluster.wait_idle(mode)
    with httpx.Client(base_url=f"{cluster.url}/{mode}", timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={"model": NAME, "prompt": PROMPT, **LONG}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # keep it: an abandoned line iterator closes the connection
            assert next(lines).startswith("data: ")
            cluster.wait_for(mode, lambda s: s.kv_cache_usage > 0 and s.num_running == 1, "the request holding KV")
    # Hung up mid-stream: the request is aborted (not finished) and every block is free again.
    after = cluster.wait_for(mode, lambda s: s.num_aborted == before.num_aborted + 1 and s.kv_cache_usage == 0
                             and s.num_running == 0, "abort and free KV")
    assert after.kv_cache_usage == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_full_queue_answers_429_with_retry_after(cluster, mode):
    """Every slot held (max_ongoing_requests = max_num_seqs per replica), one request queued
    (max_queued_requests 1): of two more, one waits and the other is refused with 429 + Retry-After."""
    num_slots = MAX_NUM_SEQS * (2 if mode == "multi" else 1)

    async def scenario():
        async with httpx.AsyncClient(base_url=f"{cluster.url}/{mode}", timeout=120) as client:
            async with contextlib.AsyncExitStack() as holds:
                readers = []  # kept alive: an abandoned line iterator closes its connection
                for i in range(num_slots):
                    response = await holds.enter_async_context(
                        client.stream("POST", "/v1/completions", json={"model": NAME, "prompt": f"hold {i}", **LONG}))
                    assert response.status_code == 200
                    readers.append(response.aiter_lines())
                    assert (await anext(readers[-1])).startswith("data: ")  # running on a replica
                body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
                probes = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
                done, pending = await asyncio.wait(probes, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                assert (len(done), len(pending)) == (1, 1)
                rejected = done.pop().result()
                assert rejected.status_code == 429, rejected.text
                assert rejected.headers["retry-after"] == str(RETRY_AFTER_S)
                if mode == "multi":  # our ingress turns Serve's backpressure into OpenAI's error shape
                    assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
            # The holds hung up: their slots free, the queued request runs.
            queued = await asyncio.wait_for(pending.pop(), 60)
            assert queued.status_code == 200 and queued.json()["usage"]["completion_tokens"] == 2

    asyncio.run(scenario())
    cluster.wait_idle(mode)


# ---- shutdown (last: it deletes the multi-replica application) --------------------------------------------
def test_deleting_the_app_ends_a_stream_its_killed_replica_cannot_finish_with_an_error_and_done(cluster):
    """Serve kills a model replica SHUTDOWN_TIMEOUT seconds after it began stopping; a stream still running
    there (1000 tokens with logprobs take the tiny model several seconds) gets an error event and [DONE]
    from the ingress, which outlives the replica by a margin, instead of a cut connection."""
    from ray import serve
    body = {"model": NAME, "prompt": PROMPT, **LONG, "logprobs": 5}
    with httpx.Client(base_url=f"{cluster.url}/multi", timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line)
            events = [next(lines)]
            serve.delete("multi", _blocking=False)
            events.extend(lines)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
    assert error["message"].startswith("the model replica stopped before the response was complete")
    assert len(events) >= 3 and all('"choices"' in e for e in events[:-2])
