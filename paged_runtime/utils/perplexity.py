"""Perplexity of a text under an engine, from its prompt logprobs (shared by the quantization test and benchmark).

Each window of ``window`` tokens is one prompt scored with ``SamplingParams(max_tokens=1,
prompt_logprobs=0)``: every prompt token's logprob given the tokens before it in its window. A window's
first token has no context and is not scored. Perplexity is exp(-mean logprob) over the scored tokens.
"""
from __future__ import annotations

import math

from paged_runtime.sampling_params import SamplingParams


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Consecutive, non-overlapping pieces of at most ``window`` tokens (the last may be shorter; a piece of
    one token scores nothing and is dropped)."""
    pieces = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    return [p for p in pieces if len(p) > 1]


def prompt_logprobs(llm, token_ids: list[int], window: int) -> list[float]:
    """Each scored token's logprob (``llm``: an ``LLM``), in text order."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    pieces = windows(token_ids, window)
    outs = llm.generate([{"prompt_token_ids": p} for p in pieces], params, use_tqdm=False)
    return [out.prompt_logprobs[i][piece[i]].logprob for piece, out in zip(pieces, outs)
            for i in range(1, len(piece))]


def perplexity(llm, token_ids: list[int], window: int) -> float:
    logprobs = prompt_logprobs(llm, token_ids, window)
    return math.exp(-sum(logprobs) / len(logprobs))
