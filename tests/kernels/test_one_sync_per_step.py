"""On CUDA a decode step waits for the device once: the sampled ids' copy back (issue 18, item 2).

Engine steps of the tiny Llama (Triton backend, CUDA graphs) run under
``torch.cuda.set_sync_debug_mode("error")``: every blocking copy (``.tolist()``, ``.item()``, ``int(t)``,
``nonzero()``, ``torch.tensor(list, device=...)``, ``from_numpy(a).to(device)`` of pageable memory) and
every stream / device synchronize raises there. The one sanctioned read, ``utils.device_inputs.to_host``,
waits on an event (``cudaEventSynchronize``), which the mode does not flag; the test counts those
separately: exactly one per step. Top-p rows are allowed one more read (the candidate ladder's), counted
in "warn" mode. CUDA only: skipped elsewhere (the CPU twin of these checks is
tests/unit/test_sampler_host_rows.py).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from tests.conftest import make_llm
from paged_runtime import SamplingParams
from paged_runtime.utils import device_inputs
from paged_runtime.worker import model_runner

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA stream syncs")]

SYNC_WARNING = "called a synchronizing CUDA operation"


def common_params() -> list[SamplingParams]:
    """Greedy, temperature, seeded, top-k, penalties, logit bias, allowed tokens, min_tokens, logprobs."""
    base = dict(max_tokens=64, ignore_eos=True)
    return [SamplingParams(temperature=0, **base),
            SamplingParams(temperature=0.8, **base),
            SamplingParams(temperature=1.0, seed=7, **base),
            SamplingParams(temperature=1.0, top_k=5, **base),
            SamplingParams(temperature=0.9, top_k=20, seed=3, **base),
            SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                           **base),
            SamplingParams(temperature=0, logit_bias={100: 5.0, 200: -3.0}, **base),
            SamplingParams(temperature=1.0, allowed_token_ids=list(range(50, 90)), **base),
            SamplingParams(temperature=0, min_tokens=40, max_tokens=64),
            SamplingParams(temperature=0.8, logprobs=3, **base)]


def decoding_engine(tiny_llama_dir, params: list[SamplingParams]):
    llm = make_llm(tiny_llama_dir, attention_backend="triton", max_model_len=256, max_num_seqs=16,
                   max_num_batched_tokens=256, kv_cache_memory=2**24, debug_checks=False)
    runner = llm.engine.core.runner
    assert runner.graphs is not None, "CUDA graphs must be on for this check"
    rng = np.random.default_rng(0)
    for i, p in enumerate(params):
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(3, 40000, 8 + i).tolist()}, p)
    for _ in range(4):  # prefill, then decode steps that warm the pinned-memory cache and the graphs
        llm.engine.step()
    torch.cuda.synchronize()
    return llm, runner


def counted_steps(llm, runner, monkeypatch, steps: int, mode: str) -> tuple[int, int, int, list[Exception]]:
    """Over ``steps`` engine steps in sync-debug ``mode``: (sanctioned reads, steps replayed from a graph,
    syncs warned about in "warn" mode, what the runner or the step raised). The engine turns a runner
    error into failed requests, so the runner's errors are recorded where they are raised."""
    reads, replayed, errors = [], [], []
    to_host, run, execute = device_inputs.to_host, runner.graphs.run, runner.execute

    def counting_to_host(*tensors):
        reads.append(len(tensors))
        return to_host(*tensors)

    def counting_run(*args):
        hidden = run(*args)
        replayed.append(hidden is not None)
        return hidden

    def recording_execute(out):
        try:
            return execute(out)
        except Exception as e:
            errors.append(e)
            raise
    monkeypatch.setattr(model_runner, "to_host", counting_to_host)
    monkeypatch.setattr(runner.graphs, "run", counting_run)
    monkeypatch.setattr(runner, "execute", recording_execute)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            for _ in range(steps):
                llm.engine.step()
        except Exception as e:  # a sync outside the runner, or the failure handling after one inside
            errors.append(e)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
    return len(reads), sum(replayed), syncs, errors


def test_common_sampling_decodes_with_one_sync_per_step(tiny_llama_dir, monkeypatch):
    llm, runner = decoding_engine(tiny_llama_dir, common_params())
    reads, replayed, _, errors = counted_steps(llm, runner, monkeypatch, 5, "error")  # any other sync raises
    assert errors == []
    assert (reads, replayed) == (5, 5)


def test_top_p_rows_add_one_read(tiny_llama_dir, monkeypatch):
    """The candidate ladder reads whether the top-p / min_p rows fit its first rung, once a step."""
    params = common_params() + [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64, ignore_eos=True),
                                SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.05, seed=5,
                                               max_tokens=64, ignore_eos=True)]
    llm, runner = decoding_engine(tiny_llama_dir, params)
    reads, replayed, syncs, errors = counted_steps(llm, runner, monkeypatch, 5, "warn")
    assert errors == []
    assert (reads, replayed, syncs) == (5, 5, 5)


def test_the_check_has_teeth(tiny_llama_dir, monkeypatch):
    """A ``.tolist()`` slipped into the sampler makes the common-case check fail."""
    llm, runner = decoding_engine(tiny_llama_dir, common_params())
    sample = runner.sampler._greedy_and_sampled

    def reading(logits, meta):
        tokens = sample(logits, meta)
        tokens.tolist()
        return tokens
    monkeypatch.setattr(runner.sampler, "_greedy_and_sampled", reading)
    reads, _, _, errors = counted_steps(llm, runner, monkeypatch, 1, "error")
    assert reads == 0 and errors and "synchronizing" in str(errors[0])


def test_staged_inputs_arrive_whole_on_the_device():
    device = torch.device("cuda")
    host = (np.arange(7, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3),
            np.array([0.5, -2.0, np.inf], np.float32), np.array([True, False, True]), np.zeros(0, np.int64),
            np.arange(5, dtype=np.int16))
    tensors = device_inputs.to_device(device, *host)
    for a, t in zip(host, tensors):
        assert t.device.type == "cuda" and tuple(t.shape) == a.shape and np.array_equal(t.cpu().numpy(), a)
    back = device_inputs.to_host(*tensors)
    assert all(t.device.type == "cpu" and np.array_equal(t.numpy(), a) for a, t in zip(host, back))
