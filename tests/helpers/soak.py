"""Soak test: many concurrent clients, good and bad, against one server for a bounded time; checks it survives.

What it does
    Starts ``python -m paged_runtime serve`` on 127.0.0.1 (a free port) as a subprocess: ``--model`` or a
    tiny random 2-layer Llama made as tests/conftest.py makes it (SmolLM2's tokenizer), with speculative
    decoding on (``--speculative-config``, default ngram k=3; ``none`` turns it off). Then ``--clients``
    clients each send one request at a time until ``--seconds`` have passed, drawing its kind from a fixed
    mix with their own seeded RNG (``--seed``; the same seed gives every client the same sequence):
      completion, completion_stream, chat, chat_stream   valid requests (logprobs, stop, seeds, echo, usage)
      parallel        n > 1 and best_of > n, streaming and not
      disconnect      a stream dropped after a few events (the client closes the connection)
      abort           a non-streaming request whose connection is closed before it finishes
      bad_value       out-of-range values (temperature -1, n 0, logprobs 21, best_of with stream, ...) -> 400
      bad_type        wrong JSON types -> 400
      unknown_model   -> 404
      malformed_json  -> 400
      wrong_content_type  a valid body sent as text/plain -> 415 (issue 19 item 9)
      lone_surrogate  "\\ud800" in the model, a prompt or a message -> 400 (item 9)
      deep_nesting    10 000 nested lists in a field -> 400 (item 9)
      oversized_body  a 17 MiB body (the server's default limit is 16 MiB) -> 413 (item 4); the bulk is in
                      the ``user`` field, so a server without a limit answers 200 quickly instead of stalling
      bounds          values that once killed the engine (item 1): repetition_penalty infinite or 1e-320,
                      min_tokens past the context -> 400; top_k above int64 (no filter) -> 200; seed 2**64-1
                      with n=2 -> 200 or 400
    Each request has a timeout (``--request-timeout``); the whole run has a hard deadline and at most
    ``--max-requests`` requests; all traffic goes to 127.0.0.1. Overload is never
    provoked (no ``--max-waiting-requests``), so every 5xx is unexpected.

Checks (exit code 1 if any fails)
    no_5xx                no response with a 5xx status;
    no_timeouts           no request timed out and no connection failed unexpectedly;
    status:<category>     every response of a category had one of its expected statuses;
    schema                every completed response (200 bodies, every streamed chunk, every error body) is valid
                          against the OpenAI spec (tests/data/openai-subset.json),
                          streams end with ``[DONE]``, give every choice a finish_reason and carry no error
                          event;
    kv_usage_zero         ``vllm:kv_cache_usage_perc`` (and running / waiting) back to 0 after the load (polled);
    health                GET /health is 200 at the end, and the server process is still running;
    rss_growth            the server's resident memory (VmRSS, sampled every second) grows by less than
                          ``--rss-growth-bound-mib`` (default 256 MiB) between the first and last quarter of
                          the run (median of each quarter's samples).

How to run
    .venv/bin/python benchmarks/soak.py                       # 10 minutes, 16 clients, tiny random Llama
    .venv/bin/python benchmarks/soak.py --seconds 60 --clients 8 --exclude bounds
    .venv/bin/python tests/helpers/soak.py --seconds 60 --clients 8 --output /tmp/soak.json

The harness lives here because tests/server/test_soak.py runs it (for 60 seconds); benchmarks/soak.py is the
same run with its result in benchmarks/results/soak-<device>.json. Writes the report to ``--output`` and
prints a table of requests by category and status, p50 / p99 latency (nearest rank) and problems, then the
checks.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.helpers.openai_spec import openai_components

REPO = Path(__file__).resolve().parents[2]
NAME = "soak-model"
MAX_MODEL_LEN = 512
OVERSIZED_BYTES = 17 * 2**20
NESTING = 10_000
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b")  # a traceback's last line
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly count paged blocks of cache "
         "and every request finds its way home before the scheduler sleeps").split()

# ---- the request mix -------------------------------------------------------------------------------------
# category -> weight. Each category's requests come from its function below (GENERATORS).
MIX = {"completion": 12, "completion_stream": 12, "chat": 10, "chat_stream": 10, "parallel": 8, "disconnect": 6,
       "abort": 5, "bad_value": 6, "bad_type": 4, "unknown_model": 3, "malformed_json": 3, "wrong_content_type": 3,
       "lone_surrogate": 3, "deep_nesting": 3, "oversized_body": 1, "bounds": 3}


@dataclass
class Case:
    category: str
    path: str
    body: dict | None = None  # sent as JSON unless ``raw`` is given
    raw: bytes | None = None
    content_type: str = "application/json"
    expected: frozenset = frozenset({200})
    mode: str = "plain"  # plain | stream | disconnect (after ``events`` events) | abort (after ``delay`` s)
    events: int = 0
    delay: float = 0.0


def _prompt(rng: random.Random) -> str | list[int]:
    if rng.random() < 0.15:
        return [rng.randrange(100, 20000) for _ in range(rng.randint(1, 30))]
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def _messages(rng: random.Random) -> list[dict]:
    messages = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "You are terse."})
    return messages


def _sampling(rng: random.Random) -> dict:
    body = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
    if rng.random() < 0.2:
        body["top_p"] = 0.9
    if rng.random() < 0.2:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.15:
        body["stop"] = [rng.choice(WORDS)]
    return body


def completion(rng, stream=False) -> Case:
    body = {"model": NAME, "prompt": _prompt(rng), **_sampling(rng)}
    if rng.random() < 0.25:
        body["logprobs"] = rng.randint(0, 3)
    if not stream and rng.random() < 0.1:
        body["echo"] = True
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return Case("completion_stream" if stream else "completion", "/v1/completions", body,
                mode="stream" if stream else "plain")


def chat(rng, stream=False) -> Case:
    body = {"model": NAME, "messages": _messages(rng), **_sampling(rng)}
    if rng.random() < 0.25:
        body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return Case("chat_stream" if stream else "chat", "/v1/chat/completions", body,
                mode="stream" if stream else "plain")


def parallel(rng) -> Case:
    n = rng.randint(2, 3)
    kind = rng.randrange(4)
    if kind == 0:
        case = completion(rng)
        case.body.update(n=n, best_of=rng.randint(n, 4), temperature=0.8)
    elif kind == 1:
        case = completion(rng, stream=True)
        case.body.update(n=n, temperature=0.8)
    else:
        case = chat(rng, stream=kind == 3)
        case.body.update(n=n, temperature=0.8)
    case.category = "parallel"
    return case


def disconnect(rng) -> Case:
    case = (completion if rng.random() < 0.5 else chat)(rng, stream=True)
    case.body["max_tokens"] = rng.randint(8, 48)
    return Case("disconnect", case.path, case.body, mode="disconnect", events=rng.randint(0, 4),
                expected=frozenset({200, "disconnected"}))


def abort(rng) -> Case:
    case = (completion if rng.random() < 0.5 else chat)(rng)
    case.body["max_tokens"] = rng.randint(8, 48)
    return Case("abort", case.path, case.body, mode="abort", delay=rng.uniform(0.0, 0.4),
                expected=frozenset({200, "aborted"}))


BAD_VALUES = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "n": 0}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "top_p": 0}),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}),
    ("/v1/completions", {"prompt": "x", "top_k": -2}),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 10}),
    ("/v1/completions", {"prompt": [10**6]}),
    ("/v1/completions", {"prompt": " ".join(["word"] * 600), "max_tokens": 20}),  # past the context
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}),
]
BAD_TYPES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}),
    ("/v1/completions", {"prompt": 5.5}),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"prompt": "x", "stop": 5}),
    ("/v1/completions", {"prompt": "x", "n": [2]}),
    ("/v1/chat/completions", {"messages": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}),
]
SURROGATES = [  # JSON text with a lone UTF-16 surrogate escape (valid JSON, not valid Unicode)
    ("/v1/completions", '{"model": "%s\\ud800", "prompt": "x", "max_tokens": 2}' % NAME),
    ("/v1/completions", '{"model": "%s", "prompt": "hi \\udc00 there", "max_tokens": 2}' % NAME),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}'
     % NAME),
]


def _pick(rng, cases, category, expected=400) -> Case:
    path, body = rng.choice(cases)
    return Case(category, path, {"model": NAME, "max_tokens": 2, **body}, expected=frozenset({expected}))


def bounds(rng) -> Case:
    """Values that once killed the engine inside a step (issue 19 item 1): refused at the edge, or served
    safely where they have a meaning (a top_k beyond the vocabulary is no filter; sibling seeds wrap)."""
    fields, expected = rng.choice([
        ({"top_k": 2**63 + 5}, {200}),
        ({"repetition_penalty": float("inf")}, {400}),  # json.dumps writes Infinity, which Python's json reads
        ({"repetition_penalty": 1e-320}, {400}),
        ({"seed": 2**64 - 1, "n": 2, "temperature": 1.0}, {200, 400}),  # the sibling seed seed + 1 overflows
        ({"min_tokens": 600}, {400}),  # chat's max_tokens unset: more than the context's room
    ])
    if "min_tokens" in fields:
        return Case("bounds", "/v1/chat/completions", {"model": NAME, "messages": _messages(rng), **fields},
                    expected=frozenset(expected))
    return Case("bounds", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2, **fields},
                expected=frozenset(expected))


def unknown_model(rng) -> Case:
    case = completion(rng) if rng.random() < 0.5 else chat(rng)
    return Case("unknown_model", case.path, {**case.body, "model": "no-such-model"}, expected=frozenset({404}))


def malformed_json(rng) -> Case:
    raw = rng.choice([b'{"model": "x", "prompt": ', b"{not json", b'{"prompt": "x",}', b"\xff\xfe{}"])
    return Case("malformed_json", "/v1/completions", raw=raw, expected=frozenset({400}))


def wrong_content_type(rng) -> Case:
    case = completion(rng) if rng.random() < 0.5 else chat(rng)
    return Case("wrong_content_type", case.path, case.body, expected=frozenset({415}),
                content_type=rng.choice(["text/plain", "application/x-www-form-urlencoded"]))


def lone_surrogate(rng) -> Case:
    path, text = rng.choice(SURROGATES)
    return Case("lone_surrogate", path, raw=text.encode(), expected=frozenset({400}))


def deep_nesting(rng) -> Case:
    nested = "[" * NESTING + "]" * NESTING
    path, text = rng.choice([
        ("/v1/completions", '{"model": "%s", "prompt": %s}' % (NAME, nested)),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (NAME, nested))])
    return Case("deep_nesting", path, raw=text.encode(), expected=frozenset({400}))


@functools.cache
def _oversized_body() -> bytes:
    return json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 1, "user": "x" * OVERSIZED_BYTES}).encode()


def oversized_body(rng) -> Case:
    return Case("oversized_body", "/v1/completions", raw=_oversized_body(), expected=frozenset({413}))


GENERATORS = {
    "completion": completion, "completion_stream": lambda rng: completion(rng, stream=True), "chat": chat,
    "chat_stream": lambda rng: chat(rng, stream=True), "parallel": parallel, "disconnect": disconnect,
    "abort": abort, "bad_value": lambda rng: _pick(rng, BAD_VALUES, "bad_value"),
    "bad_type": lambda rng: _pick(rng, BAD_TYPES, "bad_type"), "unknown_model": unknown_model,
    "malformed_json": malformed_json, "wrong_content_type": wrong_content_type, "lone_surrogate": lone_surrogate,
    "deep_nesting": deep_nesting, "oversized_body": oversized_body, "bounds": bounds}
assert set(GENERATORS) == set(MIX)


def make_case(rng: random.Random, categories: dict[str, int]) -> Case:
    """One request of a category drawn from ``categories`` (name -> weight)."""
    category = rng.choices(list(categories), weights=list(categories.values()))[0]
    return GENERATORS[category](rng)


# ---- the OpenAI spec ---------------------------------------------------------------------------------------
class SpecValidator:
    """problems(name, instance): the spec's complaints about a body (empty when valid); validators built once."""

    def __init__(self) -> None:
        import jsonschema
        components = openai_components()
        chunk = components["schemas"]["CompletionStreamChunk"]
        # With echo, the first prompt token has no logprob: OpenAI's legacy API (and vLLM) give it null in
        # token_logprobs and top_logprobs, where the spec's items are numbers and objects.
        for schema in (components["schemas"]["CreateCompletionResponse"], chunk):
            logprobs = schema["properties"]["choices"]["items"]["properties"]["logprobs"]
            fields = next(s for s in logprobs.get("anyOf", [logprobs]) if "properties" in s)["properties"]
            for name in ("token_logprobs", "top_logprobs"):
                fields[name]["items"] = {"anyOf": [fields[name]["items"], {"type": "null"}]}
        self._validators = {
            name: jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})
            for name in ("CreateCompletionResponse", "CreateChatCompletionResponse", "CompletionStreamChunk",
                         "CreateChatCompletionStreamResponse", "ErrorResponse")}

    def problems(self, name: str, instance) -> list[str]:
        out = []
        for error in self._validators[name].iter_errors(instance):
            while error.context:  # an anyOf / oneOf: its deepest branch says what is wrong
                error = max(error.context, key=lambda e: len(e.absolute_path))
            out.append(f"{name} at {'/'.join(map(str, error.absolute_path))}: {error.message[-120:]}")
        return out[:2]


# ---- one request -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    category: str
    status: int | str  # an HTTP status, or disconnected / aborted / timeout / transport_error
    latency: float
    problems: list[str] = field(default_factory=list)
    expected: frozenset = frozenset()  # the statuses this request may get


def _schema_names(path: str) -> tuple[str, str]:
    if path == "/v1/completions":
        return "CreateCompletionResponse", "CompletionStreamChunk"
    return "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse"


def check_body(case: Case, status: int, text: str, spec: SpecValidator) -> list[str]:
    """Problems with a whole (non-streamed) response: its JSON against the spec, and n choices."""
    try:
        data = json.loads(text)
    except ValueError:
        return [f"{status} body is not JSON: {text[:120]!r}"]
    if status != 200:
        return spec.problems("ErrorResponse", data)
    problems = spec.problems(_schema_names(case.path)[0], data)
    n = (case.body or {}).get("n", 1)
    if not problems and len(data["choices"]) != n:
        problems.append(f"{len(data['choices'])} choices for n={n}")
    return problems


def check_events(case: Case, events: list[str], spec: SpecValidator, complete: bool) -> list[str]:
    """Problems with a stream's events: each chunk against the spec; if ``complete``, [DONE] last and a
    finish_reason for every choice."""
    problems, finished = [], set()
    chunk_schema = _schema_names(case.path)[1]
    for event in events:
        if event == "[DONE]":
            continue
        try:
            chunk = json.loads(event)
        except ValueError:
            problems.append(f"an event is not JSON: {event[:120]!r}")
            continue
        if "error" in chunk:
            problems.append(f"error event: {json.dumps(chunk)[:160]}")
            continue
        problems += spec.problems(chunk_schema, chunk)
        finished |= {c.get("index") for c in chunk.get("choices", []) if c.get("finish_reason")}
    if complete:
        if not events or events[-1] != "[DONE]":
            problems.append("the stream did not end with [DONE]")
        n = (case.body or {}).get("n", 1)
        if len(finished) != n:
            problems.append(f"finish_reason for {len(finished)} of {n} choices")
    return problems[:3]


async def send(client: httpx.AsyncClient, base: str, case: Case, spec: SpecValidator, timeout: float) -> Outcome:
    content = case.raw if case.raw is not None else json.dumps(case.body).encode()
    request = client.build_request("POST", base + case.path, content=content,
                                   headers={"content-type": case.content_type})
    start = time.monotonic()

    def outcome(status, problems=()):
        return Outcome(case.category, status, time.monotonic() - start, list(problems), case.expected)

    try:
        if case.mode == "abort":
            try:
                response = await asyncio.wait_for(client.send(request), min(case.delay, timeout))
            except asyncio.TimeoutError:
                return outcome("aborted")  # cancelling the send closed the connection
            return outcome(response.status_code, check_body(case, response.status_code, response.text, spec))
        if case.mode in ("stream", "disconnect"):
            return await asyncio.wait_for(_stream(client, request, case, spec, outcome), timeout)
        response = await asyncio.wait_for(client.send(request), timeout)
        return outcome(response.status_code, check_body(case, response.status_code, response.text, spec))
    except asyncio.TimeoutError:
        return outcome("timeout", [f"no answer within {timeout} s"])
    except httpx.HTTPError as e:
        seen = getattr(case, "events_seen", None)
        where = "before the response" if seen is None else f"after {len(seen)} events"
        return outcome("transport_error", [f"{type(e).__name__} {where} ({time.monotonic() - start:.1f} s): {e}"[:200]])


async def _stream(client, request, case: Case, spec: SpecValidator, outcome) -> Outcome:
    response = await client.send(request, stream=True)
    try:
        if response.status_code != 200:
            await response.aread()
            return outcome(response.status_code, check_body(case, response.status_code, response.text, spec))
        events, buffer = [], ""
        case.events_seen = events  # for the report if the connection breaks
        async for text in response.aiter_text():
            buffer += text
            while "\n\n" in buffer:
                block, buffer = buffer.split("\n\n", 1)
                if not block.startswith("data: "):
                    return outcome(200, [f"not an SSE data block: {block[:120]!r}"])
                events.append(block[len("data: "):])
            if case.mode == "disconnect" and len(events) >= case.events and "[DONE]" not in events:
                return outcome("disconnected", check_events(case, events, spec, complete=False))
        problems = [f"trailing bytes after the last event: {buffer[:80]!r}"] if buffer else []
        return outcome(200, problems + check_events(case, events, spec, complete=True))
    finally:
        await response.aclose()  # mid-stream: closes the connection, which the server sees as a disconnect


async def client_loop(index: int, args, base: str, spec: SpecValidator, categories: dict[str, int], until: float,
                      results: list[Outcome]) -> None:
    rng = random.Random(args.seed * 100_003 + index)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    # Client i starts with categories i, i + clients, ...: every category is sent early, even in a short run.
    first = [{category: 1} for category in list(categories)[index::args.clients]]
    budget = args.max_requests // args.clients
    while time.monotonic() < until and budget > 0:
        # A fresh connection after each one dropped (by the client, or by the server after a 5xx it did not
        # handle): what broke one request's connection must not be counted again against the next request.
        async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
            while time.monotonic() < until and budget > 0:
                case = make_case(rng, first.pop(0) if first else categories)
                results.append(await send(client, base, case, spec, args.request_timeout))
                budget -= 1
                status = results[-1].status
                if not isinstance(status, int) or status >= 500:
                    break


# ---- the server --------------------------------------------------------------------------------------------
def make_tiny_llama(folder: Path) -> Path:
    """tests/conftest.py's tiny_llama_dir: a 2-layer random Llama (GQA, untied head), SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_runtime.models.default_model import default_model_path
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.25)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder, safe_serialization=True)
    tokenizer = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, folder / name)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, model: str, port: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "paged_runtime", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", NAME, "--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", "64", "--kv-cache-memory", "32MiB", "--disable-log-stats", "--log-level", "warning"]
    if args.speculative_config.lower() != "none":
        command += ["--speculative-config", args.speculative_config]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


async def wait_healthy(base: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} while starting")
            try:
                if (await client.get(base + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout} s")


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


async def sample_rss(pid: int, until: float, samples: list[int]) -> None:
    while time.monotonic() < until:
        value = rss_bytes(pid)
        if value is not None:
            samples.append(value)
        await asyncio.sleep(1.0)


async def engine_gauges(base: str, timeout: float) -> dict[str, float]:
    """Polls /metrics until running, waiting and KV usage are 0 (or ``timeout``); returns the last values."""
    from prometheus_client.parser import text_string_to_metric_families
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    deadline, gauges = time.monotonic() + timeout, {}
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            try:
                text = (await client.get(base + "/metrics")).text
                gauges = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                          if s.name in names and s.labels.get("model_name") == NAME}
            except (httpx.HTTPError, ValueError) as e:
                gauges = {"error": str(e)}
            if all(gauges.get(n) == 0.0 for n in names) or time.monotonic() > deadline:
                return gauges
            await asyncio.sleep(0.25)


# ---- the run -----------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: list[Outcome], categories: dict[str, int]) -> dict:
    by_category = defaultdict(list)
    for r in results:
        by_category[r.category].append(r)
    table = {}
    for category in categories:
        rows = by_category.get(category, [])
        answered = [r.latency for r in rows if isinstance(r.status, int)]
        problems = Counter(p for r in rows for p in r.problems)
        table[category] = {
            "sent": len(rows), "statuses": dict(sorted(Counter(str(r.status) for r in rows).items())),
            "p50_ms": None if not answered else round(1000 * percentile(answered, 0.5), 1),
            "p99_ms": None if not answered else round(1000 * percentile(answered, 0.99), 1),
            "problems": sum(len(r.problems) > 0 for r in rows),
            "examples": [p for p, _ in problems.most_common(3)]}
    return table


def run_checks(results, categories, gauges, health, alive, rss, args) -> list[dict]:
    def check(name, passed, detail):
        return {"name": name, "passed": bool(passed), "detail": detail}

    five = Counter(r.category for r in results if isinstance(r.status, int) and r.status >= 500)
    stuck = Counter(f"{r.category}:{r.status}" for r in results if r.status in ("timeout", "transport_error"))
    checks = [check("no_5xx", not five, f"5xx by category: {dict(five)}" if five else "none"),
              check("no_timeouts", not stuck, f"{dict(stuck)}" if stuck else "none")]
    for category in categories:
        rows = [r for r in results if r.category == category]
        allowed = frozenset().union(*(r.expected for r in rows))
        wrong = Counter(str(r.status) for r in rows if r.status not in r.expected)
        checks.append(check(f"status:{category}", rows and not wrong,
                            f"expected {sorted(map(str, allowed)) or '-'}; {len(rows)} sent" +
                            (f", unexpected {dict(wrong)}" if wrong else "")))
    invalid = [r for r in results if r.problems and r.status not in ("timeout", "transport_error")]
    checks.append(check("schema", not invalid, f"{len(invalid)} responses with problems" +
                        (f", e.g. {invalid[0].category}: {invalid[0].problems[0]}" if invalid else "")))
    kv = gauges.get("vllm:kv_cache_usage_perc")
    checks.append(check("kv_usage_zero", kv == 0.0 and gauges.get("vllm:num_requests_running") == 0.0
                        and gauges.get("vllm:num_requests_waiting") == 0.0, f"gauges at the end: {gauges}"))
    checks.append(check("health", health == 200 and alive, f"/health {health}, server running: {alive}"))
    quarter = max(1, len(rss) // 4)
    first, last = (statistics.median(rss[:quarter]) / 2**20 if rss else 0.0,
                   statistics.median(rss[-quarter:]) / 2**20 if rss else 0.0)
    checks.append(check("rss_growth", rss and last - first < args.rss_growth_bound_mib,
                        f"{last - first:+.1f} MiB (first quarter median {first:.0f} MiB, last {last:.0f} MiB; "
                        f"bound {args.rss_growth_bound_mib} MiB)" if rss else "no samples"))
    return checks


def print_report(table: dict, checks: list[dict], duration: float) -> None:
    print(f"\nsoak: {sum(row['sent'] for row in table.values())} requests in {duration:.0f} s")
    print(f"{'category':<20} {'sent':>5}  {'statuses':<34} {'p50 ms':>8} {'p99 ms':>8} {'problems':>8}")
    for category, row in table.items():
        statuses = " ".join(f"{k}:{v}" for k, v in row["statuses"].items())
        p50 = "-" if row["p50_ms"] is None else f"{row['p50_ms']:.0f}"
        p99 = "-" if row["p99_ms"] is None else f"{row['p99_ms']:.0f}"
        print(f"{category:<20} {row['sent']:>5}  {statuses:<34} {p50:>8} {p99:>8} {row['problems']:>8}")
    print()
    for c in checks:
        print(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']:<28} {c['detail']}")


async def soak(args, base: str, server: subprocess.Popen, categories: dict[str, int]) -> dict:
    spec = SpecValidator()
    results: list[Outcome] = []
    rss: list[int] = []
    start = time.monotonic()
    until = start + args.seconds
    sampler = asyncio.ensure_future(sample_rss(server.pid, until, rss))
    clients = [client_loop(i, args, base, spec, categories, until, results) for i in range(args.clients)]
    # Every request has its own timeout, so the clients end by until + request_timeout; this is the hard stop.
    try:
        await asyncio.wait_for(asyncio.gather(*clients), args.seconds + args.request_timeout + 30)
    except asyncio.TimeoutError:
        results.append(Outcome("harness", "timeout", 0.0, ["the clients did not stop by the hard deadline"]))
    sampler.cancel()
    duration = time.monotonic() - start
    gauges = await engine_gauges(base, timeout=60)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            health = (await client.get(base + "/health")).status_code
    except httpx.HTTPError as e:
        health = f"{type(e).__name__}"
    checks = run_checks(results, categories, gauges, health, server.poll() is None, rss, args)
    table = summarize(results, categories)
    return {"duration_s": round(duration, 1), "requests": len(results), "categories": table, "checks": checks,
            "gauges_at_end": gauges, "health_at_end": health,
            "rss_mib": [round(x / 2**20, 1) for x in rss[:: max(1, len(rss) // 60)]]}


def parse_args(argv=None, default_output: Path | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--model", default=None, help="a model folder; default: a tiny random Llama made here")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 3}',
                   help="the server's --speculative-config, or 'none'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--max-requests", type=int, default=100_000, help="at most this many requests in all")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--rss-growth-bound-mib", type=float, default=256.0)
    p.add_argument("--exclude", nargs="*", default=[], choices=list(MIX), help="categories to leave out")
    p.add_argument("--output", type=Path, default=default_output, required=default_output is None,
                   help="the JSON report")
    return p.parse_args(argv)


def main(argv=None, default_output: Path | None = None) -> int:
    args = parse_args(argv, default_output)
    categories = {k: v for k, v in MIX.items() if k not in args.exclude}
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        model = args.model or str(make_tiny_llama(Path(tmp) / "tiny-llama"))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            server = start_server(args, model, port, log)
            try:
                asyncio.run(wait_healthy(base, server, args.startup_timeout))
                report = asyncio.run(soak(args, base, server, categories))
            finally:
                alive = server.poll() is None
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(10)
        log_text = log_path.read_text(errors="replace")
    report["config"] = {"seconds": args.seconds, "clients": args.clients, "model": args.model or "tiny random Llama",
                        "dtype": args.dtype, "speculative_config": args.speculative_config, "seed": args.seed,
                        "request_timeout_s": args.request_timeout, "max_requests": args.max_requests,
                        "rss_growth_bound_mib": args.rss_growth_bound_mib,
                        "excluded": args.exclude, "max_model_len": MAX_MODEL_LEN}
    report["server"] = {"alive_at_end": alive, "exit_code_after_sigterm": server.returncode,
                        "log_tracebacks": log_text.count("Traceback"),
                        "log_exceptions": dict(Counter(line[:160] for line in log_text.splitlines()
                                                       if EXCEPTION_LINE.match(line))),
                        "log_errors": sum(" ERROR " in f" {line} " or line.startswith("ERROR") for line in
                                          log_text.splitlines()),
                        "log_tail": log_text.splitlines()[-40:]}
    report["passed"] = all(c["passed"] for c in report["checks"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print_report(report["categories"], report["checks"], report["duration_s"])
    server_log = report["server"]
    print(f"\nserver log: {server_log['log_tracebacks']} tracebacks, {server_log['log_errors']} ERROR lines; "
          f"wrote {args.output}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
