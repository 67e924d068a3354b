"""Constrained greedy decoding is token-identical to the oracle: transformers' logits masked by an xgrammar
matcher fed the same tokens, one token at a time (fp32, CPU, the tiny random Llama).

The engine runs with every feature on at once: chunked prefill (a small token budget), prefix-cache hits
(prompts repeated), preemption (a KV cache far too small), n-gram speculative decoding (prompts that repeat
the very text the grammar allows, so drafts are proposed, and both accepted and refused), and n > 1. Each
test asserts its workload really exercised what it claims.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.conftest import assert_idle, make_llm
from paged_runtime import SamplingParams, StructuredOutputsParams

pytestmark = [pytest.mark.slow]

EOS = 2
REGEX = r"[a-z]{1,8}( [a-z]{1,8}){0,5}\."
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["alpha", "beta"]}},
          "required": ["word", "count", "kind"], "additionalProperties": False}
CONSTRAINTS = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(json=SCHEMA),
               StructuredOutputsParams(choice=["red apple", "green pear", "blue plum"]),
               StructuredOutputsParams(grammar='root ::= "x=" [0-9]+ ";" | "y"')]


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def oracle(model, backend, constraint, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by hand: full forward, mask the last logits with the matcher's bitmask, argmax."""
    import xgrammar as xgr
    matcher = backend.matcher(backend.compile(constraint))
    bitmask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            out.append(token)
            if token == EOS:
                break
            assert matcher.accept_token(token)
            ids.append(token)
    return out


def prompts(tokenizer) -> list[list[int]]:
    """Prompts that hold text the grammars allow (drafts for the n-gram proposer), and a shared prefix."""
    texts = ["alpha beta gamma. word count kind alpha 12", '{"word": "ab", "count": 7, "kind": "beta"} x=12;',
             "red apple green pear blue plum red apple", "x=1; x=22; x=333; y y y x=4444; x=",
             "the cat sat on the mat. the cat sat on the mat. the cat"]
    shared = tokenizer.encode("A long shared system preamble, " * 6)
    return [shared + tokenizer.encode(t) for t in texts]


def test_constrained_greedy_matches_the_oracle_with_every_feature_on(tiny_llama_dir, tiny_hf, tokenizer):
    llm = make_llm(tiny_llama_dir, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=6, block_size=16,
                   kv_cache_memory=16 * 16 * (2 * 2 * 2 * 16 * 4),  # 16 blocks: forces preemption
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                       "prompt_lookup_min": 1})
    backend = llm.engine.grammars
    cases = [(p, c) for p in prompts(tokenizer) for c in CONSTRAINTS]
    cases += cases[:4]  # repeated prompts: prefix-cache hits of whole prompts
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=c) for _, c in cases]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], params, use_tqdm=False)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert core.spec_stats.num_draft_tokens > core.spec_stats.num_accepted_tokens > 0, "drafts accepted and refused"
    assert core.kv_cache.num_hit_tokens > 0, "repeated prompts were meant to hit the prefix cache"
    for (prompt, constraint), out in zip(cases, outs):
        assert out.outputs[0].token_ids == oracle(tiny_hf, backend, constraint, prompt, 24), constraint
    assert_idle(llm)


def test_sampled_outputs_always_match_their_constraint(tiny_llama_dir, tokenizer):
    llm = make_llm(tiny_llama_dir, max_model_len=512, max_num_batched_tokens=64, kv_cache_memory=4 * 2**20,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                       "prompt_lookup_min": 1})
    checks = {"regex": lambda text: re.fullmatch(REGEX, text),
              "json": lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None,
              "choice": lambda text: text in ("red apple", "green pear", "blue plum"),
              "grammar": lambda text: re.fullmatch(r"x=[0-9]+;|y", text)}
    for constraint in CONSTRAINTS:
        params = SamplingParams(n=4, max_tokens=60, temperature=1.0, seed=5, structured_outputs=constraint)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(tokenizer)], params, use_tqdm=False)
        finished = [c for out in outs for c in out.outputs if c.finish_reason == "stop"]
        assert len(finished) >= 5, f"too few {constraint.kind} outputs finished to check"
        for completion in finished:
            assert checks[constraint.kind](completion.text), completion.text
    assert_idle(llm)
