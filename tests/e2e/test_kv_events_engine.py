"""KV-cache events from a real engine (the tiny random Llama): a known prompt's blocks with the hashes vLLM's
definition gives, evictions under cache pressure, and ``AllBlocksCleared`` on a prefix-cache reset, read back
through the replay socket (inproc: same process, no port)."""
from __future__ import annotations

import uuid

import pytest

from tests.conftest import assert_idle, make_llm
from tests.helpers.kv_events import low64, replayed_batches, vllm_block_hashes
from paged_runtime import SamplingParams

BS = 16
SEED = "7"
PER_BLOCK = BS * 2 * 2 * 2 * 16 * 4  # tokens x layers x KV heads x (K, V) x head size x float32


def events_llm(tiny_llama_dir, monkeypatch, **kwargs):
    """An LLM publishing its KV events (PYTHONHASHSEED fixed, so the hashes can be recomputed); its replay
    endpoint."""
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    name = uuid.uuid4().hex
    config = {"enable_kv_cache_events": True, "endpoint": f"inproc://kv-{name}",
              "replay_endpoint": f"inproc://kv-replay-{name}", "topic": "kv"}
    return make_llm(tiny_llama_dir, kv_events_config=config, block_size=BS, **kwargs), config["replay_endpoint"]


def stored_blocks(batches) -> tuple[list[int], list[int], list]:
    """(hashes, token ids, parents) of every BlockStored, in order."""
    stored = [e for _, events in batches for e in events if e[0] == "BlockStored"]
    assert all(e[4:] == [BS, None, "GPU", None] for e in stored)
    return [h for e in stored for h in e[1]], [t for e in stored for t in e[3]], [e[2] for e in stored]


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_a_prompts_blocks_are_published_with_vllms_hashes_then_cleared(tiny_llama_dir, monkeypatch, algo):
    llm, replay = events_llm(tiny_llama_dir, monkeypatch, prefix_caching_hash_algo=algo, max_model_len=128,
                             kv_cache_memory=16 * PER_BLOCK)
    prompt = list(range(1000, 1040))  # 2 full blocks and 8 tokens
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    tokens = prompt + list(out.outputs[0].token_ids)  # 50: the last one's KV is never written, so 3 full blocks
    batches = replayed_batches(replay)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    hashes, token_ids, parents = stored_blocks(batches)
    expected = [low64(h) for h in vllm_block_hashes(algo, SEED, tokens, BS)]
    assert len(expected) == 3 and hashes == expected and token_ids == tokens[:48]
    assert parents == [None, expected[1]]  # the prompt's 2 blocks at prefill, the third once decoding fills it
    assert not any(e[0] != "BlockStored" for _, events in batches for e in events)
    assert_idle(llm)
    llm.reset_prefix_cache()
    assert replayed_batches(replay, len(batches)) == [(len(batches), [["AllBlocksCleared"]])]


def test_eviction_under_cache_pressure_is_published(tiny_llama_dir, monkeypatch):
    # 4 blocks, one request at a time. a (48 tokens + 1) holds 4 blocks and caches 3; freed tail first, the free
    # queue is [a's 4th, a2, a1, a0]; b's prefill takes 3 blocks: the plain one, then a2 and a1 are evicted.
    llm, replay = events_llm(tiny_llama_dir, monkeypatch, prefix_caching_hash_algo="sha256_cbor",
                             max_model_len=64, max_num_seqs=1, kv_cache_memory=4 * PER_BLOCK)
    assert llm.engine.core.num_blocks == 4
    greedy = SamplingParams(max_tokens=1, temperature=0)
    a, b = list(range(2000, 2048)), list(range(3000, 3048))
    llm.generate([{"prompt_token_ids": a}], greedy, use_tqdm=False)
    first = replayed_batches(replay)
    llm.generate([{"prompt_token_ids": b}], greedy, use_tqdm=False)
    second = replayed_batches(replay, len(first))
    a_hashes = [low64(h) for h in vllm_block_hashes("sha256_cbor", SEED, a, BS)]
    b_hashes = [low64(h) for h in vllm_block_hashes("sha256_cbor", SEED, b, BS)]
    assert stored_blocks(first)[0] == a_hashes
    assert [events for _, events in second] == [[  # one step: b's blocks taken, then computed and stored
        ["BlockRemoved", [a_hashes[2], a_hashes[1]], "GPU"], ["BlockStored", b_hashes, None, b, BS, None, "GPU", None]]]
    assert_idle(llm)


def test_no_events_config_records_nothing(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_model_len=128, kv_cache_memory=16 * PER_BLOCK)
    core = llm.engine.core
    assert core.kv_events is None and core.kv_cache.pool.events is None
    assert type(core.kv_event_publisher).__name__ == "NullEventPublisher"


@pytest.mark.parallel
@pytest.mark.slow
def test_tensor_parallel_ranks_share_one_publisher(tiny_llama_dir, monkeypatch):
    """Two tensor-parallel ranks, one engine: each block is published once, with the same hashes as one rank."""
    llm, replay = events_llm(tiny_llama_dir, monkeypatch, tensor_parallel_size=2, max_model_len=128,
                             kv_cache_memory=16 * PER_BLOCK)
    prompt = list(range(2000, 2040))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    tokens = prompt + list(out.outputs[0].token_ids)
    hashes, token_ids, _ = stored_blocks(replayed_batches(replay))
    assert hashes == [low64(h) for h in vllm_block_hashes("sha256", SEED, tokens, BS)] and token_ids == tokens[:48]
    llm.engine.shutdown()
