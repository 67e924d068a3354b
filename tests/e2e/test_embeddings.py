"""--runner pooling: a decoder run as an embedder, checked against transformers' final hidden states (after the
model's final norm, as vLLM pools them) pooled LAST / MEAN / CLS and normalised, in float32, within 1e-4.

Also: chunked prefill (a prompt over several steps), prefix-cache hits (LAST uses them, MEAN skips them by
rule: ``pooling_params``), a batch mixing lengths, Matryoshka dimensions, the sentence-transformers folder
config, and the refusals between generate and pooling.
"""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import assert_idle, make_llm
from paged_runtime.pooling_params import PoolingParams, folder_pooling_type

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModel
    return AutoModel.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def hf_embedding(model, ids: list[int], pooling: str, normalize: bool = True, dimensions: int | None = None):
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].float()  # after the final norm
    vector = {"LAST": hidden[-1], "CLS": hidden[0]}.get(pooling, hidden.mean(dim=0))
    vector = vector[:dimensions] if dimensions else vector
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).numpy()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def last_llm(tiny_llama_dir):
    # 32-token chunks: the 100-token prompts take several steps
    return make_llm(tiny_llama_dir, runner="pooling", max_model_len=256, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def mean_llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, runner="pooling", pooling_type="MEAN", max_model_len=256,
                    max_num_batched_tokens=32)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_batch_of_mixed_lengths_matches_transformers(request, hf_model, pooling):
    llm = request.getfixturevalue("last_llm" if pooling == "LAST" else "mean_llm")
    batch = prompts(1, [1, 5, 17, 100, 33, 64])
    outputs = llm.embed([{"prompt_token_ids": p} for p in batch], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == batch
    for ids, out in zip(batch, outputs):
        assert len(out.outputs.embedding) == 64 == out.outputs.hidden_size
        np.testing.assert_allclose(out.outputs.embedding, hf_embedding(hf_model, ids, pooling), atol=TOL, rtol=0)
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5
    assert_idle(llm)


def test_text_prompt_and_unnormalised_matryoshka(last_llm, hf_model):
    ids = last_llm.get_tokenizer().encode("The lighthouse keeper counted the ships.")
    out, = last_llm.embed("The lighthouse keeper counted the ships.", use_tqdm=False,
                          pooling_params=PoolingParams(normalize=False, dimensions=16))
    np.testing.assert_allclose(out.outputs.embedding, hf_embedding(hf_model, ids, "LAST", False, 16), atol=TOL,
                               rtol=0)
    assert len(out.outputs.embedding) == 16
    short, = last_llm.embed(ids, use_tqdm=False, pooling_params=PoolingParams(dimensions=16))
    np.testing.assert_allclose(short.outputs.embedding, hf_embedding(hf_model, ids, "LAST", True, 16), atol=TOL,
                               rtol=0)


def test_chunked_prefill_takes_several_steps(last_llm, hf_model):
    ids, = prompts(2, [150])
    engine = last_llm.engine
    engine.add_request("chunked", {"prompt_token_ids": ids}, _params(), pooling=engine.pooling_params())
    steps, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        steps += 1
    assert steps == 5  # ceil(150 / 32): one output, at the end
    out, = outputs
    assert out.finished and out.outputs == [] and out.error is None
    np.testing.assert_allclose(out.pooling.data, hf_embedding(hf_model, ids, "LAST"), atol=TOL, rtol=0)


def _params():
    from paged_runtime import SamplingParams
    return SamplingParams(max_tokens=1)


def test_last_pooling_uses_the_prefix_cache_and_gives_the_same_vector(last_llm, hf_model):
    ids, = prompts(3, [90])
    kv = last_llm.engine.core.kv_cache
    first, = last_llm.embed([ids], use_tqdm=False)
    hits = kv.num_hit_tokens
    second, = last_llm.embed([ids], use_tqdm=False)
    assert kv.num_hit_tokens - hits == 80  # five full blocks of 16: the last token is always computed
    assert second.outputs.embedding == pytest.approx(first.outputs.embedding, abs=1e-6)
    np.testing.assert_allclose(second.outputs.embedding, hf_embedding(hf_model, ids, "LAST"), atol=TOL, rtol=0)
    assert_idle(last_llm)


def test_mean_pooling_skips_prefix_cache_hits_but_stores_its_blocks(mean_llm, hf_model):
    ids, = prompts(4, [90])
    kv = mean_llm.engine.core.kv_cache
    cached = len(kv.pool.cached)
    first, = mean_llm.embed([ids], use_tqdm=False)
    assert len(kv.pool.cached) == cached + 5  # its five full blocks of 16 were published
    hits = kv.num_hit_tokens
    second, = mean_llm.embed([ids], use_tqdm=False)
    assert kv.num_hit_tokens == hits  # never starts from cached rows: every prompt row is pooled
    np.testing.assert_allclose(second.outputs.embedding, first.outputs.embedding, atol=1e-6, rtol=0)
    np.testing.assert_allclose(second.outputs.embedding, hf_embedding(hf_model, ids, "MEAN"), atol=TOL, rtol=0)


def test_cls_pooling_keeps_the_first_chunks_row_and_skips_prefix_cache_hits(tiny_llama_dir, hf_model):
    llm = make_llm(tiny_llama_dir, runner="pooling", pooling_type="CLS", max_model_len=256, max_num_batched_tokens=32)
    ids, = prompts(7, [90])  # three chunks: the first one's first row is the vector
    kv = llm.engine.core.kv_cache
    first, second = (llm.embed([ids], use_tqdm=False)[0] for _ in range(2))
    assert kv.num_hit_tokens == 0 and len(kv.pool.cached) >= 5  # its blocks are published, never read back
    for out in (first, second):
        np.testing.assert_allclose(out.outputs.embedding, hf_embedding(hf_model, ids, "CLS"), atol=TOL, rtol=0)
    assert_idle(llm)


def test_sentence_transformers_config_picks_the_pooling(tiny_llama_dir, tmp_path, hf_model):
    folder = tmp_path / "st"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert folder_pooling_type(folder) == "MEAN" and folder_pooling_type(tiny_llama_dir) is None
    llm = make_llm(folder, task="embed", max_model_len=128)
    assert llm.engine.config.runner == "pooling" and llm.engine.pooling_type == "MEAN"
    ids, = prompts(5, [20])
    out, = llm.embed([ids], use_tqdm=False)
    np.testing.assert_allclose(out.outputs.embedding, hf_embedding(hf_model, ids, "MEAN"), atol=TOL, rtol=0)


def test_generate_and_embed_refuse_the_other_runner(last_llm, tiny_llama_dir):
    with pytest.raises(ValueError, match="runner='pooling'"):
        last_llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="generat"):
        last_llm.engine.add_request("x", "hello", _params())
    generator = make_llm(tiny_llama_dir, max_model_len=128)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generator.embed(["hello"], use_tqdm=False)
    from paged_runtime.sampling_params import ParameterError
    with pytest.raises(ParameterError, match="dimensions"):
        last_llm.embed(["hello"], use_tqdm=False, pooling_params=PoolingParams(dimensions=65))
    assert_idle(last_llm)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_asynchronous_scheduling_gives_the_same_vectors(tiny_llama_dir, hf_model, pooling):
    llm = make_llm(tiny_llama_dir, runner="pooling", pooling_type=pooling, max_model_len=256,
                   max_num_batched_tokens=32, async_scheduling=True)
    batch = prompts(6, [3, 70, 40])
    outputs = llm.embed([{"prompt_token_ids": p} for p in batch], use_tqdm=False)
    for ids, out in zip(batch, outputs):
        np.testing.assert_allclose(out.outputs.embedding, hf_embedding(hf_model, ids, pooling), atol=TOL, rtol=0)
    assert_idle(llm)
