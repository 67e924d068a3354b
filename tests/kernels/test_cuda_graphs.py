"""Decode steps replayed from captured graphs give the same greedy tokens as eager steps.

On a GPU the engine captures real CUDA graphs. Without one, the same DecodeGraphs runs
over the Triton interpreter with a stand-in capture whose replay re-runs the captured
call on the static buffers: that checks what the GPU path relies on (inputs copied in,
padding rows that never store, the pinned split count, outputs read back) except the
capture itself.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams
from paged_runtime.worker.cuda_graphs import DecodeGraphs, capture_sizes

pytestmark = [pytest.mark.kernels]


def eager_capture(fn, pool):
    out = fn()
    return (lambda: out.copy_(fn())), out


def workload():
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 40, 17, 70, 1)]
    # Different lengths: the decode batch shrinks 5 -> 1, replaying padded sizes 6, 4 and exact ones.
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (5, 6, 7, 8, 9)]
    return [{"prompt_token_ids": p} for p in prompts], params


def test_capture_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert capture_sizes(1000) == capture_sizes(256)  # capped, each size once


def test_graph_replay_matches_eager_steps(tiny_llama_dir):
    assert_replay_matches_eager(tiny_llama_dir)


@pytest.mark.parametrize("quantization, op", [("int4", "w4a16_linear"), ("int8", "w8a16_linear")])
def test_graph_replay_of_quantized_weights_matches_eager_steps(tiny_llama_dir, monkeypatch, quantization, op):
    """The weight-only Triton GEMMs (W4A16, W8A16) are captured with the decode step: replayed steps give the
    eager steps' tokens, which the op computed (``calls``; a replay on a GPU runs no Python, so the tokens are
    the evidence the graphs hold it). Without a GPU ``triton_applies`` is forced, so they run interpreted."""
    from paged_runtime.kernels import triton_ops
    from paged_runtime.layers.quantization import int4, int8
    interpreted = not torch.cuda.is_available()
    if interpreted:
        for module in (int4, int8):
            monkeypatch.setattr(module, "triton_applies", lambda x: True)
    calls, real = [], getattr(triton_ops, op)
    monkeypatch.setattr(triton_ops, op, lambda *args: calls.append(op) or real(*args))
    assert_replay_matches_eager(tiny_llama_dir, quantization=quantization)
    assert calls, f"{quantization} layers multiplied through {op}" + (" (interpreted)" if interpreted else "")


def assert_replay_matches_eager(folder, **llm_args) -> None:
    """The workload's greedy tokens from eager steps and from steps replayed from captured graphs (padded to 6
    and 4 rows, and at an exact size) are the same."""
    common = dict(attention_backend="triton", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=6,
                  kv_cache_memory=2**20, **llm_args)
    prompts, params = workload()
    eager = make_llm(folder, enforce_eager=True, **common)
    assert eager.engine.core.runner.graphs is None
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    llm = make_llm(folder, **common)
    runner = llm.engine.core.runner
    if runner.graphs is None:  # no GPU: graphs over the interpreter with the stand-in capture
        assert runner.device.type == "cpu"
        runner.graphs = DecodeGraphs(runner.model, runner.block_size, 6, 256, runner.device,
                                     capture=eager_capture)
        runner.graphs.capture_all()
    replayed, run = [], runner.graphs.run

    def counting_run(input_ids, *args):
        hidden = run(input_ids, *args)
        if hidden is not None:
            batch = input_ids.shape[0]
            size = next(s for s in runner.graphs.sizes if s >= batch)
            assert (runner.graphs.slot_mapping[batch:size] == -1).all()  # padding rows never store
            replayed.append(batch)
        return hidden
    runner.graphs.run = counting_run
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert {5, 3, 1} <= set(replayed)  # padded to 6 and to 4, and an exact size
    assert_idle(llm)


def test_graph_replay_with_lora_adapters_matches_peft(tiny_llama_dir, tmp_path):
    """The graphs capture LoRA's launches over a static row -> slot buffer: decode steps that mix two adapters
    and the base model replay, and their tokens are peft's."""
    from tests.helpers.lora import ADAPTERS, make_adapters, peft_greedy
    from paged_runtime import LoRARequest
    specs = {name: ADAPTERS[name] for name in ("sql", "chat")}
    adapters = make_adapters(tiny_llama_dir, tmp_path, specs)
    llm = make_llm(tiny_llama_dir, attention_backend="triton", max_model_len=256, max_num_seqs=6,
                   kv_cache_memory=2**20, enable_lora=True, max_loras=2)
    runner = llm.engine.core.runner
    if runner.graphs is None:
        runner.graphs = DecodeGraphs(runner.model, runner.block_size, 6, 256, runner.device, capture=eager_capture,
                                     lora_step=runner.lora.step)
        runner.graphs.capture_all()
    assert runner.lora.step.row_slots is None, "capture leaves the step's map as it found it"
    replayed, run = [], runner.graphs.run

    def counting_run(input_ids, *args):
        hidden = run(input_ids, *args)
        if hidden is not None:
            replayed.append(sorted(set(runner.graphs.row_slots[:input_ids.shape[0]].tolist())))
        return hidden
    runner.graphs.run = counting_run
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 12, 8)]
    names = ["sql", "chat", None]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, temperature=0),
                        use_tqdm=False,
                        lora_request=[LoRARequest(n, i + 1, str(adapters[n])) if n else None
                                      for i, n in enumerate(names)])
    assert [-1, 0, 1] in replayed, "a replayed step mixed both adapters and the base model"
    for prompt, name, out in zip(prompts, names, outs):
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama_dir, adapters[name] if name else None,
                                                       [prompt], 6)[0]
    assert_idle(llm)
