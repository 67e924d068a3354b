"""An encoder-only family (``BertModel``, all-MiniLM-L6-v2's shape) served as a pooling model, checked against
transformers' ``BertModel`` ``last_hidden_state`` pooled the same way (CLS, MEAN; normalised and not) in float32,
within 1e-4, for batches mixing texts and token-id lists of different lengths in one step.

Also what the engine promises an encoder: every prompt computed whole in one step (no chunked prefill, a
budget covering max_model_len), no prefix cache (no hits, nothing stored), no KV cache at all; the runner it
picks (auto pools) and what it refuses; the sentence-transformers folder's pooling; checkpoints with the
``bert.`` prefix and heads, a vocab.txt tokenizer; asynchronous scheduling and two tensor-parallel ranks.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_idle, make_llm
from tests.helpers.tiny_bert import MAX_POSITIONS, add_sentence_transformers_modules, save_vocab_txt_tokenizer
from paged_runtime import SamplingParams
from paged_runtime.pooling_params import folder_max_seq_length, folder_pooling_type
from paged_runtime.sampling_params import ParameterError

TOL = 1e-4
TEXTS = ["The lighthouse keeper counted the ships.", "Fog!", "A ship over the harbour at dawn, 42 lights again"]
TOKEN_IDS = [[7], [9, 30, 12, 44, 61, 8, 70, 15, 22], [(i * 37) % 90 + 5 for i in range(70)]]


@pytest.fixture(scope="module")
def hf_bert(tiny_bert_dir):
    from transformers import BertModel
    return BertModel.from_pretrained(tiny_bert_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cls_llm(tiny_bert_dir):
    return make_llm(tiny_bert_dir)  # runner auto; no sentence-transformers config: BERT's default, CLS


@pytest.fixture(scope="module")
def st_dir(tiny_bert_dir, tmp_path_factory):
    """The same weights as a sentence-transformers folder declaring MEAN (as all-MiniLM-L6-v2 does)."""
    folder = tmp_path_factory.mktemp("st-bert") / "model"
    shutil.copytree(tiny_bert_dir, folder)
    add_sentence_transformers_modules(folder, "MEAN")
    return folder


@pytest.fixture(scope="module")
def mean_llm(st_dir):
    return make_llm(st_dir, runner="pooling")


def hf_vector(model, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # token types 0, every position attended
    vector = hidden[0] if pooling == "CLS" else hidden.mean(dim=0)
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).numpy()


def record_schedules(monkeypatch, llm) -> list[list[tuple[int, int]]]:
    """Each step's scheduled items as (start, tokens), in the scheduler's order, while the test runs."""
    scheduler, steps = llm.engine.core.scheduler, []
    schedule = scheduler.schedule

    def recorded():
        out = schedule()
        steps.append([(s.start, s.num_new_tokens) for s in out.scheduled])
        return out
    monkeypatch.setattr(scheduler, "schedule", recorded)
    return steps


def embed_all(llm, prompts, normalize: bool):
    """Every prompt added, then steps until done: their outputs, in prompt order."""
    engine, outputs = llm.engine, {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=1), pooling=engine.pooling_params(
            normalize=normalize))
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_a_mixed_batch_runs_in_one_step_and_matches_transformers(request, monkeypatch, hf_bert, pooling, normalize):
    llm = request.getfixturevalue("cls_llm" if pooling == "CLS" else "mean_llm")
    assert llm.engine.config.runner == "pooling" and llm.engine.pooling_type == pooling
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(t) for t in TEXTS] + TOKEN_IDS
    assert all(i[0] == tokenizer.cls_token_id and i[-1] == tokenizer.sep_token_id for i in ids[:3])
    assert tokenizer.unk_token_id not in sum(ids[:3], [])
    steps = record_schedules(monkeypatch, llm)
    outputs = embed_all(llm, TEXTS + [{"prompt_token_ids": p} for p in TOKEN_IDS], normalize)
    # One step, each prompt whole: bidirectional attention needs every token of a prompt at once.
    assert steps == [[(0, len(i)) for i in ids]]
    for prompt_ids, out in zip(ids, outputs):
        assert out.finished and out.error is None and out.prompt_token_ids == prompt_ids
        np.testing.assert_allclose(out.pooling.data, hf_vector(hf_bert, prompt_ids, pooling, normalize), atol=TOL,
                                   rtol=0)
    core = llm.engine.core
    assert core.attention_backend == "encoder" and core.runner.kv_caches == []
    assert core.kv_cache.num_queried_tokens == core.kv_cache.num_hit_tokens == 0 and not core.kv_cache.pool.cached
    assert_idle(llm)


def test_the_same_prompts_again_are_computed_again_with_nothing_cached(cls_llm):
    kv = cls_llm.engine.core.kv_cache
    first = cls_llm.embed(TEXTS, use_tqdm=False)
    second = cls_llm.embed(TEXTS, use_tqdm=False)
    assert [o.outputs.embedding for o in second] == [o.outputs.embedding for o in first]
    assert kv.num_hit_tokens == 0 and not kv.pool.cached  # prefix caching is off for an encoder
    assert all(abs(np.linalg.norm(o.outputs.embedding) - 1) < 1e-5 for o in second)


def test_a_prompt_that_does_not_fit_the_step_left_waits_whole_for_the_next(tiny_bert_dir, monkeypatch, hf_bert):
    llm = make_llm(tiny_bert_dir, max_model_len=64, max_num_batched_tokens=64)
    prompts = [[(i * 7 + n) % 90 + 5 for i in range(n)] for n in (40, 30, 20)]
    steps = record_schedules(monkeypatch, llm)
    outputs = embed_all(llm, [{"prompt_token_ids": p} for p in prompts], normalize=True)
    # 40 fits, 30 would not fit the 24 left (never chunked: passed over), 20 does; then 30 in a step of its own.
    assert steps == [[(0, 40), (0, 20)], [(0, 30)]]
    for ids, out in zip(prompts, outputs):
        np.testing.assert_allclose(out.pooling.data, hf_vector(hf_bert, ids, "CLS", True), atol=TOL, rtol=0)
    assert_idle(llm)


def test_asynchronous_scheduling_over_several_steps_gives_the_same_vectors(tiny_bert_dir, cls_llm):
    prompts = (TEXTS + [{"prompt_token_ids": p} for p in TOKEN_IDS]) * 3
    llm = make_llm(tiny_bert_dir, async_scheduling=True, max_num_seqs=4)  # 18 requests, 4 a step
    got = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    want = [o.outputs.embedding for o in cls_llm.embed(prompts, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert_idle(llm)


def test_bert_prefixed_checkpoint_with_heads_loads_the_same(tiny_bert_dir, tmp_path, cls_llm):
    folder = tmp_path / "bert-for-something"
    shutil.copytree(tiny_bert_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    renamed = {f"bert.{name}": t for name, t in tensors.items()}
    renamed["cls.predictions.bias"] = torch.zeros(len(cls_llm.get_tokenizer()))  # a task head: not loaded
    (folder / "model.safetensors").unlink()
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    llm = make_llm(folder)
    got = llm.embed(TEXTS, use_tqdm=False)
    want = cls_llm.embed(TEXTS, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.embedding for o in got], [o.outputs.embedding for o in want], atol=1e-6,
                               rtol=0)


def test_a_vocab_txt_tokenizer_tokenizes_alike(tiny_bert_dir, tmp_path, cls_llm):
    folder = tmp_path / "vocab-txt"
    shutil.copytree(tiny_bert_dir, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    save_vocab_txt_tokenizer(folder)
    tokenizer = make_llm(folder).get_tokenizer()
    assert [tokenizer.encode(t) for t in TEXTS] == [cls_llm.get_tokenizer().encode(t) for t in TEXTS]


def test_sentence_transformers_pooling_config_is_read(st_dir, tmp_path):
    assert folder_pooling_type(st_dir) == "MEAN"
    for pooling in ("CLS", "LAST"):
        folder = tmp_path / pooling
        folder.mkdir()
        add_sentence_transformers_modules(folder, pooling)
        assert folder_pooling_type(folder) == pooling
    both = tmp_path / "both"
    both.mkdir()
    add_sentence_transformers_modules(both, "MEAN")
    config = both / "1_Pooling" / "config.json"
    config.write_text(config.read_text().replace('"pooling_mode_cls_token": false', '"pooling_mode_cls_token": true'))
    assert folder_pooling_type(both) is None  # sentence-transformers would concatenate CLS and MEAN


def test_max_seq_length_of_a_sentence_transformers_folder_is_the_default_max_model_len(st_dir, tmp_path):
    assert make_llm(st_dir, runner="pooling").engine.max_model_len == MAX_POSITIONS  # no sentence_bert_config
    folder = tmp_path / "capped"
    shutil.copytree(st_dir, folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    assert folder_max_seq_length(folder) == 40
    assert make_llm(folder).engine.max_model_len == 40
    assert make_llm(folder, max_model_len=96).engine.max_model_len == 96  # asked for: up to the positions
    (folder / "sentence_bert_config.json").write_text("{not json")
    assert folder_max_seq_length(folder) is None


def test_generate_is_refused_at_config_time_naming_the_architecture(tiny_bert_dir):
    with pytest.raises(ValueError, match="^BertModel is an encoder-only model: it can only pool"):
        make_llm(tiny_bert_dir, runner="generate")


def test_a_step_budget_below_max_model_len_is_refused(tiny_bert_dir):
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens \(100\) is smaller than max_model_len \(128\): "
                                         r"BertModel is an encoder-only model"):
        make_llm(tiny_bert_dir, max_num_batched_tokens=100)


def test_generation_and_overlong_prompts_are_refused_and_a_requested_backend_is_ignored(tiny_bert_dir, cls_llm):
    with pytest.raises(ValueError, match="runner='pooling'"):
        cls_llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ParameterError) as error:
        cls_llm.embed([[5] * MAX_POSITIONS], use_tqdm=False)
    assert error.value.param == "prompt"
    llm = make_llm(tiny_bert_dir, attention_backend="torch")  # a decoder's backend: attends causally over a cache
    assert llm.engine.core.attention_backend == "encoder"
    assert_idle(cls_llm)


@pytest.mark.parallel
def test_two_tensor_parallel_ranks_give_the_same_vectors_and_pipeline_stages_are_refused(tiny_bert_dir, cls_llm):
    llm = make_llm(tiny_bert_dir, tensor_parallel_size=2)
    try:
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    want = [o.outputs.embedding for o in cls_llm.embed(TEXTS, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)  # partial products summed in another order
    with pytest.raises(ValueError, match="BertModel runs on one pipeline stage"):
        make_llm(tiny_bert_dir, pipeline_parallel_size=2)
