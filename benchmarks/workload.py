"""The ShareGPT-like workload every benchmark draws from (numpy only, no torch).

Prompt and output lengths are lognormal (long tails) with the given means,
prompts are capped at half the model length and outputs so that prompt +
output fits; prompts are random ordinary token ids. The same seed gives the
same requests in every script, so offline and served figures compare.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIRST_ORDINARY_ID = 3  # SmolLM2's special tokens are ids 0..2


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """Integer lengths >= 1 whose (uncapped) mean is ``mean``."""
    mu = np.log(mean) - sigma ** 2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(int)


def make_workload(seed: int, n: int, prompt_mean: float, output_mean: float, sigma: float, max_model_len: int,
                  vocab_size: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.minimum(lognormal_lengths(rng, prompt_mean, sigma, n), max_model_len // 2)
    output_lens = np.minimum(lognormal_lengths(rng, output_mean, sigma, n), max_model_len - prompt_lens)
    return [Request(rng.integers(FIRST_ORDINARY_ID, vocab_size, int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens)]
