"""Decode steps whose rows run LoRA adapters take the compiled CPU decode step, which adds each row's delta after
every product: greedy tokens equal transformers + peft's for each prompt (float32; adapter rows, rows of another
adapter and base rows in the same steps), and in bfloat16 equal the op-by-op path on the same kernels.

The adapters (``helpers/lora.py``): "sql" of rank 8 on q and v (padded to the slots' 16; k, o and the MLP get
zeros), "chat" of rank 16 with rsLoRA on every linear."""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import assert_idle, count_decode_steps, make_llm
from tests.helpers.lora import ADAPTERS, make_adapters, peft_greedy
from paged_runtime import LoRARequest, SamplingParams
from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu.load(default_cache_dir()), reason="no C compiler: the CPU kernels are off")]

LORA = dict(cpu_kernels=True, enable_lora=True, max_loras=2, max_lora_rank=16)
NAMES = ["sql", "chat", None, "sql", "chat", None, "chat"]  # each adapter's rows and base rows in every step


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"),
                         {name: ADAPTERS[name] for name in ("sql", "chat")})


def workload(adapters) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Prompts of several lengths and their adapters (``NAMES``)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 17, 40, 9, 23, 2, 31)]
    lora = {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(adapters.items(), start=1)}
    return prompts, [lora[name] if name else None for name in NAMES]


def generate(llm, prompts, requests, max_tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False,
                        lora_request=requests)
    return [o.outputs[0].token_ids for o in outs]


def peft_tokens(base_dir, adapters, prompts, max_tokens: int) -> list[list[int]]:
    """peft's greedy tokens for each prompt under its adapter (``NAMES``), one model per adapter."""
    expected = {}
    for name in set(NAMES):
        mine = [i for i, n in enumerate(NAMES) if n == name]
        outs = peft_greedy(base_dir, adapters[name] if name else None, [prompts[i] for i in mine], max_tokens)
        expected.update(zip(mine, outs))
    return [expected[i] for i in range(len(prompts))]


def record_lora_rows(monkeypatch) -> list[list[int] | None]:
    """Each compiled decode step's row -> slot map (None: no row ran an adapter) while the test runs."""
    steps, run = [], cpu.DecodeStack.run

    def recorded(self, x, residual, positions, slots, block_tables, context_lens, block_size, lora_slots=None):
        steps.append(None if lora_slots is None else lora_slots.tolist())
        return run(self, x, residual, positions, slots, block_tables, context_lens, block_size, lora_slots)
    monkeypatch.setattr(cpu.DecodeStack, "run", recorded)
    return steps


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3}],
                         ids=["plain", "ngram"])
def test_adapter_rows_take_the_compiled_decode_step_and_give_peft_tokens(tiny_llama_dir, adapters, monkeypatch,
                                                                         speculative_config):
    fused_calls, lora_rows = count_decode_steps(monkeypatch), record_lora_rows(monkeypatch)
    prompts, requests = workload(adapters)
    llm = make_llm(tiny_llama_dir, speculative_config=speculative_config, **LORA)
    assert llm.engine.core.ops.name == "cpu-kernels"
    assert generate(llm, prompts, requests, 12) == peft_tokens(tiny_llama_dir, adapters, prompts, 12)
    assert fused_calls and len(fused_calls) == len(lora_rows)
    # steps of both adapters' rows beside base rows ran as one C call each
    assert any(set(rows) == {-1, 0, 1} for rows in lora_rows if rows is not None)
    assert_idle(llm)


def test_bfloat16_adapter_rows_give_the_op_by_op_kernels_tokens(tiny_llama_dir, adapters, monkeypatch):
    """The compiled step rounds where the per-op kernels round (cpu_linear, then cpu_lora_delta), so bfloat16
    tokens are the same either way."""
    fused_calls = count_decode_steps(monkeypatch)
    prompts, requests = workload(adapters)
    op_by_op = make_llm(tiny_llama_dir, **LORA | {"dtype": "bfloat16"})
    op_by_op.engine.core.executor.worker.runner.cpu_plans = {}  # every step op by op, on the same kernels
    expected = generate(op_by_op, prompts, requests, 8)
    assert not fused_calls
    compiled = make_llm(tiny_llama_dir, **LORA | {"dtype": "bfloat16"})
    assert compiled.engine.core.ops.name == "cpu-kernels" and compiled.engine.core.dtype == torch.bfloat16
    assert generate(compiled, prompts, requests, 8) == expected
    assert fused_calls
