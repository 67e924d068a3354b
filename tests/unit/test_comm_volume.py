"""paged_runtime/utils/comm_volume.py's formulas equal the collectives a real parallel step calls.

One process plays tensor-parallel rank 0 of every pipeline stage: the engine's in-process worker is the
driver (rank 0 of the last stage) and the earlier stages' workers run each step first. torch.distributed is
replaced by counters (an all-reduce leaves the partial sum, an all-gather repeats this rank's shard, a
receive yields zeros), so the tokens are meaningless but every call, and its tensor, is the real one.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from paged_runtime import SamplingParams
from paged_runtime.executor import base
from paged_runtime.layers.linear import TensorParallel
from paged_runtime.layers.pipeline import PipelineStage
from paged_runtime.models.config import ModelConfig
from paged_runtime.utils.comm_volume import rank_bytes, rank_calls
from paged_runtime.worker import worker as worker_module
from paged_runtime.worker.worker import Placement, Worker, driver_rank
from tests.conftest import make_llm


class Collectives:
    """torch.distributed's calls, counted per pipeline stage (``stage``: the rank running now)."""

    def __init__(self) -> None:
        self.stage, self.calls, self.bytes = 0, Counter(), Counter()

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[self.stage, kind] += 1
        self.bytes[self.stage, kind] += tensor.numel() * tensor.element_size()

    def install(self, monkeypatch) -> None:
        def all_gather(parts, tensor, group=None):
            self.record("all_gather", tensor)
            for part in parts:
                part.copy_(tensor)

        def recv(tensor, src=None):
            self.record("recv", tensor)
            tensor.zero_()

        monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, group=None: self.record("all_reduce", x))
        monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
        monkeypatch.setattr(torch.distributed, "send", lambda x, dst=None: self.record("send", x))
        monkeypatch.setattr(torch.distributed, "recv", recv)


def fake_init_parallel(p: Placement, device: torch.device):
    """init_parallel's shard and stage, without a process group."""
    return (TensorParallel(p.tp_rank, p.tp_size, None),
            PipelineStage(p.pp_rank, p.pp_size, p.rank - p.tp_size if p.pp_rank else None,
                          p.rank + p.tp_size if p.pp_rank < p.pp_size - 1 else None))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_counted_collectives_match_the_formula_every_step(tiny_llama_dir, monkeypatch, tp, pp):
    collectives = Collectives()
    collectives.install(monkeypatch)
    monkeypatch.setattr(worker_module, "init_parallel", fake_init_parallel)
    monkeypatch.setattr(base, "Placement", lambda: Placement(driver_rank(tp, pp), tp, pp))
    # 16 tokens a step: the 23-token prompt is cut into chunks, and the first chunk's step samples nothing
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory=2**24,
                   enable_prefix_caching=False)
    executor = llm.engine.core.executor
    earlier = [Worker(executor.worker.spec, Placement(stage * tp, tp, pp)) for stage in range(pp - 1)]
    for w in earlier:
        w.load()
        w.init_cache(executor.info.num_blocks)
    steps = []

    def execute(out):
        collectives.calls.clear()
        collectives.bytes.clear()
        for stage, w in enumerate(earlier):  # each stage runs the step before the next receives it
            collectives.stage = stage
            assert w.execute(out) is None
        collectives.stage = pp - 1
        result = base.UniProcExecutor.execute(executor, out)
        steps.append((sum(s.num_scheduled for s in out.scheduled), sum(s.samples for s in out.scheduled),
                      dict(collectives.calls), dict(collectives.bytes)))
        return result

    executor.execute = execute
    prompts = [list(range(10, 10 + n)) for n in (23, 5, 11)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    llm.engine.core.shutdown()
    model = ModelConfig.from_folder(tiny_llama_dir)
    assert any(sampled == 0 for _, sampled, _, _ in steps) and len(steps) >= 4
    for num_tokens, num_sampled, calls, counted in steps:
        for stage in range(pp):
            want = rank_bytes(model, tp, pp, stage, num_tokens, num_sampled, 4)
            want_calls = rank_calls(model, tp, pp, stage, num_sampled > 0)
            for kind in want:
                assert counted.get((stage, kind), 0) == want[kind], (stage, kind, num_tokens, num_sampled)
                assert calls.get((stage, kind), 0) == want_calls[kind], (stage, kind, num_tokens, num_sampled)
