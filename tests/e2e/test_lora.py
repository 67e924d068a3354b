"""LoRA adapters are token-identical to transformers + peft on the same base and adapter (fp32, CPU greedy).

Adapters are made with peft in the test run over the tiny random Llama (three of them: different ranks and
target sets, one with rsLoRA) and over a tiny Qwen3. One batch mixes the three adapters and the base model with
chunked prefill, prefix-cache hits, preemption and n > 1 on, and the test asserts each of those happened. The
rest: adapters never share KV blocks with each other or the base model (the same adapter does); --max-loras
bounds the adapters of a step without starving anyone; an adapter removed while its requests run lets them
finish; what PEFT would compute otherwise is refused with the reason; tensor parallelism shards adapters.
"""
from __future__ import annotations

import json
import random

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import assert_idle, copy_tokenizer, make_llm
from tests.helpers.lora import ADAPTERS, make_adapter, make_adapters, peft_greedy
from tests.helpers.ngram import oracle_ngram
from paged_runtime import LoRARequest, SamplingParams
from paged_runtime.lora import slots as lora_slots
from paged_runtime.lora.request import LoRAError

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


def requests_of(adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def oracle(base_dir, adapters, prompts, names, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """peft's greedy tokens for each (prompt, adapter name or None)."""
    expected = {}
    for name in set(names):
        mine = [p for p, n in zip(prompts, names) if n == name]
        outs = peft_greedy(base_dir, adapters[name] if name else None, mine, max_tokens)
        expected.update({(name, tuple(p)): o for p, o in zip(mine, outs)})
    return [expected[(n, tuple(p))] for p, n in zip(prompts, names)]


def record_steps(monkeypatch) -> list[set[int]]:
    """The adapter ids of each step's rows, as the workers' slot tables see them."""
    steps, prepare = [], lora_slots.LoRASlots.prepare

    def recorded(self, row_lora_ids):
        steps.append(set(row_lora_ids.tolist()) - {0})
        return prepare(self, row_lora_ids)
    monkeypatch.setattr(lora_slots.LoRASlots, "prepare", recorded)
    return steps


def test_mixed_batch_matches_peft_with_every_engine_feature(tiny_llama_dir, adapters, monkeypatch):
    steps = record_steps(monkeypatch)
    lora = requests_of(adapters)
    shared = random_prompts([40], seed=5)[0]
    # First: the shared prompt under "sql", so that the batch below finds its blocks cached.
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=256,
                   max_num_batched_tokens=64, max_num_seqs=6, block_size=16,
                   kv_cache_memory=16 * 16 * (2 * 2 * 2 * 16 * 4))  # 16 blocks: the batch needs more at once
    first = llm.generate([{"prompt_token_ids": shared}], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                         use_tqdm=False, lora_request=lora["sql"])[0]
    # The shared prompt first (admitted before the pressure below evicts its cached blocks).
    names = ["sql", "chat", "sql", "chat", "mlp", None, "sql", "chat", None, "mlp"]
    prompts = [shared, shared] + random_prompts([5, 130, 17, 70, 33, 9, 100, 60], seed=6)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=2 if i == 4 else 1) for i in range(len(names))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[lora[n] if n else None for n in names])
    core = llm.engine.core
    assert max(map(len, prompts)) > 64, "a prompt longer than the step budget is computed in chunks"
    assert core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert outs[0].num_cached_tokens == 32, "the same adapter's cached prefix (two full blocks) is reused"
    assert outs[1].num_cached_tokens == 0, "another adapter's cached blocks are never reused"
    assert max(len(s) for s in steps) == 2 and all(len(s) <= 2 for s in steps), "max_loras bounds every step"
    expected = oracle(tiny_llama_dir, adapters, [shared] + prompts, ["sql"] + names)
    assert first.outputs[0].token_ids == expected[0]
    for out, want, name in zip(outs, expected[1:], names):
        for completion in out.outputs:
            assert completion.token_ids == want, f"adapter {name} diverged from peft"
    assert len(outs[4].outputs) == 2
    assert expected[1] != expected[2], "the two adapters answer the shared prompt differently"
    assert_idle(llm)


FAMILIES = {
    # Qwen3: q/k norms after the adapted q/k projections; Phi-3: fused qkv_proj / gate_up_proj checkpoint modules,
    # whose adapters cover every part of our fused layers (A shared, B split by the parts' rows).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True),
              ADAPTERS["chat"]["targets"]),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_match_peft(tmp_path, smollm2_dir, family):
    import torch
    import transformers
    config_class, model_class, extra, targets = FAMILIES[family]
    base = tmp_path / family
    config = getattr(transformers, config_class)(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, initializer_range=0.25,
        **extra)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).to(torch.float32).save_pretrained(base)
    copy_tokenizer(smollm2_dir, base)
    adapter = make_adapter(base, tmp_path / f"{family}-lora", r=8, targets=targets, seed=4)
    llm = make_llm(base, enable_lora=True, max_lora_rank=8, max_model_len=256)
    prompts = random_prompts([12, 45], seed=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                        use_tqdm=False, lora_request=[LoRARequest("a", 1, str(adapter)), None])
    expected = oracle(base, {"a": adapter}, prompts, ["a", None])
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected[0] != oracle(base, {}, prompts[:1], [None])[0], "the adapter changes the output"


def test_max_loras_admits_first_in_line_without_starving(tiny_llama_dir, adapters, monkeypatch):
    """max_loras=1: a step never mixes adapters; a request whose adapter must wait blocks those behind it, so a
    stream of "sql" requests cannot starve the "chat" one that came before them."""
    steps = record_steps(monkeypatch)
    lora = requests_of(adapters)
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=1, max_model_len=256)
    engine = llm.engine
    names = ["sql", "chat", "sql", "sql", None]
    prompts = random_prompts([9, 9, 9, 9, 9], seed=8)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0),
                           lora_request=lora[name] if name else None)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert all(len(s) <= 1 for s in steps)
    order = list(finished)
    assert order.index("r1") < order.index("r2"), "the later sql requests waited behind chat"
    # One slot and room for one read adapter: sql was evicted for chat and read again from its folder.
    assert [finished[f"r{i}"] for i in range(5)] == oracle(tiny_llama_dir, adapters, prompts, names, 4)
    assert_idle(llm)


def test_removed_adapter_lets_running_requests_finish(tiny_llama_dir, adapters):
    lora = requests_of(adapters)
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_model_len=256)
    engine = llm.engine
    prompt = random_prompts([11], seed=9)[0]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                       lora_request=lora["sql"])
    outputs = engine.step()
    assert engine.remove_lora(1) and engine.list_loras() == set()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.finished][0]
    assert final.outputs[0].token_ids == oracle(tiny_llama_dir, adapters, [prompt], ["sql"])[0]
    assert 1 not in engine.core.runner.lora.requests, "the workers dropped it after its last request"
    assert not engine.remove_lora(1)


def adapter_copy(src, dst, edit_config=None, edit_tensors=None):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    if edit_config:
        edit_config(config)
    if edit_tensors:
        tensors = edit_tensors(tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


@pytest.mark.parametrize("case,reason", [
    ("rank", "rank 16 is over --max-lora-rank 8"),
    ("modules_to_save", "modules_to_save"),
    ("dora", "DoRA adapters are not supported"),
    ("unknown_module", "is not a linear layer LlamaForCausalLM serves LoRA on"),
    ("shape", "do not fit"),
    ("missing", "has no adapter_config.json"),
    ("no_weights", "has no adapter_model.safetensors"),
])
def test_an_adapter_that_cannot_run_is_refused_with_the_reason(tiny_llama_dir, adapters, tmp_path, case, reason):
    src = adapters["chat"] if case == "rank" else adapters["sql"]
    edits = {
        "rank": {},
        "modules_to_save": dict(edit_config=lambda c: c.update(modules_to_save=["lm_head"])),
        "dora": dict(edit_config=lambda c: c.update(use_dora=True)),
        "unknown_module": dict(edit_tensors=lambda t: {k.replace("self_attn.q_proj", "self_attn.qq_proj"): v
                                                       for k, v in t.items()}),
        "shape": dict(edit_tensors=lambda t: {k: (v[:, :-1].contiguous() if "lora_A" in k else v)
                                              for k, v in t.items()}),
    }
    if case == "missing":
        folder = tmp_path / "nothing-here"
    elif case == "no_weights":
        folder = tmp_path / "config-only"
        folder.mkdir()
        (folder / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    else:
        folder = adapter_copy(src, tmp_path / case, **edits[case])
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_lora_rank=8, max_model_len=128)
    with pytest.raises(LoRAError, match=reason):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("x", 1, str(folder)))
    assert llm.engine.list_loras() == set()
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2, "the engine goes on serving"
    assert_idle(llm)


def test_lora_needs_enable_lora(tiny_llama_dir, adapters):
    llm = make_llm(tiny_llama_dir, max_model_len=128)
    with pytest.raises(LoRAError, match="--enable-lora"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("sql", 1, str(adapters["sql"])))


@pytest.mark.slow
def test_tensor_parallel_shards_adapters_like_their_layers(tiny_llama_dir, adapters):
    lora = requests_of(adapters)
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=3, tensor_parallel_size=2, max_model_len=256)
    names = ["sql", "chat", "mlp", None]
    prompts = random_prompts([7, 30, 12, 20], seed=10)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                        use_tqdm=False, lora_request=[lora[n] if n else None for n in names])
    assert [o.outputs[0].token_ids for o in outs] == oracle(tiny_llama_dir, adapters, prompts, names)


def test_ngram_speculation_and_structured_outputs_run_with_adapters(tiny_llama_dir, adapters, monkeypatch):
    """Drafts are verified with the request's adapter: the proposer is handed peft's own continuations, some
    spoiled (``helpers.ngram``), and the tokens stay peft's with drafts both accepted and rejected. A constrained
    request keeps its constraint under an adapter."""
    from paged_runtime import StructuredOutputsParams
    from paged_runtime.spec_decode.ngram import NgramProposer
    lora = requests_of(adapters)
    names = ["chat", "sql", None]
    prompts = random_prompts([20, 15, 9], seed=12)
    expected = oracle(tiny_llama_dir, adapters, prompts, names, 16)
    monkeypatch.setattr(NgramProposer, "propose", oracle_ngram([p + e for p, e in zip(prompts, expected)]))
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=2, max_model_len=256,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0),
                        use_tqdm=False, lora_request=[lora[n] if n else None for n in names])
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.core.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    choice = SamplingParams(max_tokens=8, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(["Is it raining?"], choice, use_tqdm=False, lora_request=lora["mlp"])[0]
    assert out.outputs[0].text in ("yes", "no")
    assert_idle(llm)
