"""Shared fixtures: a tiny random Llama (and a tiny random BERT) saved as a real safetensors folder, the embedded
SmolLM2.

Every engine a test builds runs with the block-accounting invariant checks on.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled kernels and converted models go into this run's own cache (a private temporary folder, removed at
# exit) unless the caller names one: a test run never writes into the user's ~/.cache. Set before collection:
# skip conditions load the kernels. Subprocesses (servers, ranks, ISA variants) inherit it.
if not os.environ.get("PAGED_RUNTIME_CACHE"):
    os.environ["PAGED_RUNTIME_CACHE"] = tempfile.mkdtemp(prefix="paged_runtime-tests-")
    atexit.register(shutil.rmtree, os.environ["PAGED_RUNTIME_CACHE"], ignore_errors=True)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A cache folder of the test's own as ``$PAGED_RUNTIME_CACHE`` (the models it converts start from nothing and
    stay there), holding the run's compiled kernel library as a hard link: building it again for each such test
    cost a minute of compiling a test on a 2-core machine (12 minutes of a run), and the loader takes the link as
    its own (a private folder, a regular file of this user's)."""
    from paged_runtime.kernels import cpu
    run_cache, cache = os.environ["PAGED_RUNTIME_CACHE"], tmp_path / "cache"
    cpu.load(run_cache)  # built once per run (a no-op once loaded; False without a compiler)
    library = cpu.library_path(run_cache)
    linked = cache / library.parent.name / library.name
    linked.parent.mkdir(parents=True, mode=0o700)
    if library.is_file():
        os.link(library, linked)
    monkeypatch.setenv("PAGED_RUNTIME_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def smollm2_dir():
    from paged_runtime.models.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_plain_dir(smollm2_dir, tmp_path_factory):
    """The default model's dequantized weights as a plain checkpoint: its files without the GGUF blocks."""
    folder = tmp_path_factory.mktemp("smollm2-plain")
    for f in smollm2_dir.iterdir():
        if f.is_file():
            (folder / f.name).symlink_to(f)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir):
    """A 2-layer Llama with GQA, untied head and SmolLM2's tokenizer.

    Weights are drawn with a large std so the top token wins by a clear margin:
    greedy identity must not hinge on float rounding between near-ties.
    """
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


def save_tiny_llama(folder, smollm2_dir, **config):
    """tiny_llama_dir's model (``config`` changes its LlamaConfig: other sizes or head counts) saved in folder with
    SmolLM2's tokenizer; returns folder."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{**dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                   initializer_range=0.25), **config})
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(smollm2_dir, folder)
    return folder


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A 2-layer random BertModel (an encoder: it only pools) with a WordPiece tokenizer, built offline
    (``helpers/tiny_bert.py``); no sentence-transformers files (its pooling is the family's, CLS)."""
    from tests.helpers.tiny_bert import save_tiny_bert
    folder = tmp_path_factory.mktemp("tiny-bert")
    save_tiny_bert(folder)
    return folder


@pytest.fixture(scope="session")
def two_models_dir(tmp_path_factory, tiny_llama_dir, smollm2_dir):
    """A folder of two models (several models, one server): alpha, the tiny Llama; beta, the same shape with
    other weights (so an answer from the wrong model shows)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("models")
    (root / "alpha").symlink_to(tiny_llama_dir, target_is_directory=True)
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_llama_dir)).to(torch.float32).save_pretrained(
        root / "beta", safe_serialization=True)
    copy_tokenizer(smollm2_dir, root / "beta")
    return root


def copy_tokenizer(tokenizer_dir, folder) -> None:
    """SmolLM2's tokenizer files into a tiny model's folder (the engine loads the tokenizer from there)."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy completion of one prompt: the oracle's tokens."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None, temperature=None)
    return out[0, len(prompt_ids):].tolist()


def make_llm(model_dir, **kwargs):
    from paged_runtime import LLM
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("debug_checks", True)
    return LLM(model=str(model_dir), **kwargs)


def assert_idle(llm) -> None:
    """After a test's requests finish, every block is back in the free queue."""
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv_cache.num_free_blocks == core.num_blocks
    core.scheduler.check_invariants()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a reaped child no longer does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def count_decode_steps(monkeypatch) -> list[tuple[int, int]]:
    """Record each compiled CPU decode step (``kernels.cpu.DecodeStack``) as (layers, rows) while the test runs:
    the steps that ran every decoder layer in one call."""
    from paged_runtime.kernels import cpu
    calls, run = [], cpu.cpu_decode_stack

    def counted(x, residual, stack, num_layers, *args):
        calls.append((num_layers, x.shape[0]))
        return run(x, residual, stack, num_layers, *args)
    monkeypatch.setattr(cpu, "cpu_decode_stack", counted)
    return calls
