"""The Triton backend inside the runtime: greedy outputs identical to the torch backend.

Forced with attention_backend="triton" (without a GPU the kernels run in
Triton's interpreter, see conftest). One workload covers the runner's varlen metadata
for every kind of item: prompt chunks (a small token budget), prefix-cache hits (the
workload runs twice), decodes, and speculative verification with a draft model that
itself runs on the same metadata path.
"""
from __future__ import annotations

import random

import pytest

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams
from paged_runtime.spec_decode.truncated_draft import write_truncated_draft

pytestmark = [pytest.mark.kernels]


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory):
    return write_truncated_draft(tiny_llama_dir, tmp_path_factory.mktemp("tiny-draft"), 1)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    system = [rng.randrange(3, 49152) for _ in range(40)]
    return [system + [rng.randrange(3, 49152) for _ in range(n)] for n in (3, 25)] + \
        [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 50)]


def generate_twice(llm) -> list[list[int]]:
    """The second pass hits the prefix cache the first one filled."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for _ in range(2):
        got = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        outs += [o.outputs[0].token_ids for o in got]
    return outs


def test_greedy_identical_to_torch_backend(tiny_llama_dir, tiny_draft_dir, monkeypatch):
    common = dict(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory=2**20)
    expected = generate_twice(make_llm(tiny_llama_dir, attention_backend="torch", **common))
    llm = make_llm(tiny_llama_dir, attention_backend="triton", **common, speculative_config={
        "method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 2})
    assert llm.engine.core.runner.attention_backend == "triton"
    assert generate_twice(llm) == expected
    core = llm.engine.core
    assert core.kv_cache.num_hit_tokens > 0
    assert 0 < core.spec_stats.num_accepted_tokens < core.spec_stats.num_draft_tokens
    assert_idle(llm)
