"""Beam search equals transformers' generate(num_beams=k, do_sample=False) and frees dropped beams."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_idle, make_llm
from paged_runtime import BeamSearchParams


def hf_beams(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float, early_stopping):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                         max_new_tokens=max_tokens, do_sample=False, length_penalty=length_penalty,
                         early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True,
                         top_k=None, top_p=None, temperature=None)
    pad = model.generation_config.pad_token_id
    rows = []
    for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        # transformers pads shorter hypotheses after their EOS.
        eos_at = next((i for i, t in enumerate(row) if t == 2), None)
        rows.append((row[:eos_at + 1] if eos_at is not None else row, score))
    return rows


@pytest.mark.parametrize("width, length_penalty, early_stopping", [(2, 1.0, False), (4, 0.5, True),
                                                                   (3, 1.5, "never")])
def test_tiny_beam_search_matches_transformers(tiny_llama_dir, width, length_penalty, early_stopping):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    llm = make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=4 * 2**20)
    prompts = [list(range(500, 512)), [7, 8, 9], list(range(900, 940))]
    params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        expected = hf_beams(hf, prompt, width, 12, length_penalty, early_stopping)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
        for sequence, (_, score) in zip(out.sequences, expected):
            assert sequence.score == pytest.approx(score, abs=1e-4)
    assert_idle(llm)


@pytest.mark.slow
def test_smollm2_beam_search_matches_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    llm = make_llm(smollm2_dir, quantization="none", max_model_len=256, kv_cache_memory=64 * 2**20)
    tokenizer = llm.get_tokenizer()
    prompts = ["The best way to learn a language is", "def add(a, b):"]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=16))
    for text, out in zip(prompts, outs):
        expected = hf_beams(hf, tokenizer.encode(text), 3, 16, 1.0, False)
        assert out.sequences[0].tokens == expected[0][0]
        assert out.sequences[0].text == tokenizer.decode(expected[0][0], skip_special_tokens=True)
    assert_idle(llm)


def test_dropped_beams_free_their_blocks_at_once(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_model_len=256, kv_cache_memory=4 * 2**20)
    core = llm.engine.core
    peak = []
    original = core.step

    def step(sync=False):
        updates = original(sync)
        live = len(core.scheduler.requests)
        held = core.num_blocks - core.kv_cache.num_free_blocks
        peak.append((live, held))
        return updates

    core.step = step
    llm.beam_search([{"prompt_token_ids": list(range(100, 140))}], BeamSearchParams(beam_width=4, max_tokens=20))
    # 40-token prompt = 3 blocks shared by all beams; each beam adds at most one private block
    # per 16 tokens: never more than 3 + 4 * 3 blocks, and never more than 4 live beams.
    assert max(live for live, _ in peak) <= 4
    assert max(held for _, held in peak) <= 3 + 4 * 3
    assert_idle(llm)
