"""KV-cache events from a live ``paged-runtime serve --kv-events-config ...``, read by a real pyzmq subscriber: a
known prompt's blocks (vLLM's sha256_cbor hashes, recomputed here, and their token ids), evictions under cache
pressure, replay of the batches a dropped subscriber missed, and ``AllBlocksCleared`` after
``POST /reset_prefix_cache``.

The endpoint is a plain address, so the server connects to it (vLLM's rule: it binds only wildcard, ipc and
inproc endpoints) and the subscriber binds it; everything stays on 127.0.0.1.
"""
from __future__ import annotations

import json
import signal
import time

import httpx
import msgpack
import pytest
import zmq

from tests.helpers.kv_events import END_SEQ, ask_replay, low64, receive, vllm_block_hashes
from .conftest import free_socket
from .test_cli import run_cli

BS = 16
SEED = "11"
PER_BLOCK = BS * 2 * 2 * 2 * 16 * 4  # the tiny Llama's KV bytes per block in float32


def free_port() -> int:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    return port


def wait_healthy(url: str, proc, sub) -> None:
    """Until the server answers /health, polling ``sub`` meanwhile: a ZMQ socket takes in a new connection (here
    the server's PUB) and sends it its subscription only when it is used, and a PUB drops what it sends before a
    subscription reaches it."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert not sub.poll(200), "an event before any request"


def complete(url: str, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def next_batch(sub) -> tuple[int, list]:
    topic, seq, payload = receive(sub, 10_000)
    ts, events, rank = msgpack.unpackb(payload)
    assert topic == b"kv@tiny" and rank == 0 and abs(ts - time.time()) < 60
    return int.from_bytes(seq, "big"), events


def stored(token_ids: list[int], parent=None) -> list:
    hashes = [low64(h) for h in vllm_block_hashes("sha256_cbor", SEED, token_ids, BS)]
    return ["BlockStored", hashes, parent, token_ids, BS, None, "GPU", None]


@pytest.mark.server
@pytest.mark.slow
def test_a_live_servers_kv_events(tiny_llama_dir):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub_port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay_endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{sub_port}",
              "replay_endpoint": replay_endpoint, "topic": "kv@tiny"}
    # 4 blocks, one request at a time; each 48-token prompt takes 3 from the free queue, which a request leaves
    # tail first: a takes 0-2; b takes 3 and evicts a2, a1; c evicts a0, b2, b1.
    proc = run_cli("serve", str(tiny_llama_dir), "--port", str(port), "--dtype", "float32", "--max-model-len", "64",
                   "--max-num-seqs", "1", "--kv-cache-memory", str(4 * PER_BLOCK), "--served-model-name", "tiny",
                   "--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", json.dumps(config),
                   env={"PYTHONHASHSEED": SEED})
    url = f"http://127.0.0.1:{port}"
    a, b, c = (list(range(start, start + 48)) for start in (2000, 3000, 4000))
    hashes = {name: [low64(h) for h in vllm_block_hashes("sha256_cbor", SEED, p, BS)]
              for name, p in (("a", a), ("b", b), ("c", c))}
    try:
        wait_healthy(url, proc, sub)
        complete(url, a)
        assert next_batch(sub) == (0, [stored(a)])  # the prompt's 3 full blocks, hashed as vLLM hashes them
        complete(url, b)
        assert next_batch(sub) == (1, [["BlockRemoved", hashes["a"][2:0:-1], "GPU"], stored(b)])

        sub.close(linger=0)  # the subscriber drops out; what it misses stays in the replay buffer
        complete(url, c)  # takes a0 (in the free queue since a), then b's last two
        missed = ask_replay(replay_endpoint, 2)
        assert [int.from_bytes(seq, "big") for seq, _ in missed[:-1]] == [2] and missed[-1] == [END_SEQ, b""]
        assert msgpack.unpackb(missed[0][1])[1] == [
            ["BlockRemoved", [hashes["a"][0], *hashes["b"][2:0:-1]], "GPU"], stored(c)]
        assert [int.from_bytes(seq, "big") for seq, _ in ask_replay(replay_endpoint, 0)[:-1]] == [0, 1, 2]
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=10).status_code == 200
        deadline = time.monotonic() + 30
        while len(cleared := ask_replay(replay_endpoint, 3)) == 1:  # only the end marker: not published yet
            assert time.monotonic() < deadline, "no batch after the reset"
            time.sleep(0.05)
        assert [int.from_bytes(cleared[0][0], "big"), msgpack.unpackb(cleared[0][1])[1]] == [3, [["AllBlocksCleared"]]]

        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'vllm:kv_events_dropped_batches_total{model_name="tiny"} 0.0' in metrics
    finally:
        sub.close(linger=0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
