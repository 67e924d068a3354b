"""Turns a user prompt and its parameters into a validated token-level request.

``SamplingParams`` validates itself; what depends on this engine (its vocabulary,
context length and batch limit) and the prompt are checked here. Everything a
client can get wrong raises ``ParameterError`` with the field in ``param``,
before the request reaches the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass

from paged_runtime.sampling_params import ParameterError, SamplingParams

PromptType = str | dict | list[int]


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    max_tokens: int


class Processor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, max_num_seqs: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """The prompt's token ids and its output budget (max_tokens clamped to the room left in the context)."""
        self._check_params(params)
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ParameterError("prompt is empty: it must contain at least one token", "prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParameterError(f"prompt token id {bad[0]} is out of range for vocabulary size {self.vocab_size}",
                                 "prompt")
        if len(token_ids) >= self.max_model_len:
            raise ParameterError(f"prompt is {len(token_ids)} tokens long, but max_model_len is "
                                 f"{self.max_model_len} (prompt plus at least one output token must fit)", "prompt")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return ProcessedPrompt(text, token_ids, max_tokens)

    def _check_params(self, params: SamplingParams) -> None:
        # n first: best_of defaults to n, and the client should hear about the field it actually sent.
        for name, value in (("n", params.n), ("best_of", params.best_of)):
            if value > self.max_num_seqs:
                raise ParameterError(f"{name} ({value}) must not exceed this server's max_num_seqs "
                                     f"({self.max_num_seqs})", name)
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ParameterError(f"{name} token id {bad[0]} is out of range for vocabulary size "
                                     f"{self.vocab_size}", name)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._as_ids(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ParameterError("a dict prompt needs 'prompt' (a string) or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, list):
            return None, self._as_ids(prompt)
        raise ParameterError(f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}",
                             "prompt")

    @staticmethod
    def _as_ids(ids) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ParameterError("prompt_token_ids must be a list of integers", "prompt")
        return list(ids)
