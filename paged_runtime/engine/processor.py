"""Turns a user prompt and its parameters into a validated token-level request.

``SamplingParams`` validates itself; what depends on this engine (its vocabulary,
context length, batch limit and stop-string caps) and the prompt are checked
here. Everything a client can get wrong raises ``ParameterError`` with the
field in ``param``, before the request reaches the scheduler.

``check`` is the engine's second line: what ``add_request`` runs on a prompt
processed elsewhere (another thread's copy of this class, or a caller's own
``ProcessedPrompt``), so nothing a step cannot run gets in. It is cheap: no
tokenizing, one pass over the token ids.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paged_runtime.sampling_params import INVALID_VALUE, ParameterError, SamplingParams
from paged_runtime.structured_output.backend import GrammarBackend

PromptType = str | dict | list[int]


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The longest text that could still be a prompt: ``max_model_len`` tokens of the longest token text.

    A token's text (the raw vocabulary string: one character per byte or piece) is never shorter than what
    it decodes to, so a longer text needs at least ``max_model_len`` tokens. Checked before tokenizing: a
    multi-megabyte prompt is refused at once instead of holding a tokenizer thread for seconds.
    """
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max_model_len * max(len(t) for t in tokens if t is not None)


def check_prompt_chars(text: str, limit: int) -> None:
    """ParameterError (param "prompt") for a text too long to be a prompt of this engine, untokenized."""
    if len(text) > limit:
        raise ParameterError(f"prompt is {len(text)} characters long: more than any prompt that fits "
                             f"max_model_len ({limit} characters at most)", "prompt")


def check_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """ParameterError unless ``logprobs`` and ``prompt_logprobs`` are within the engine's ``max_logprobs``
    (the routes run it too, where they can name the field as the client spelled it)."""
    for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None and value > max_logprobs:
            raise ParameterError(f"{name} must be at most this server's max_logprobs ({max_logprobs}), got {value}",
                                 name, INVALID_VALUE)


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    max_tokens: int


class Processor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, max_num_seqs: int, *, max_stop_strings: int,
                 max_stop_string_length: int, max_logprobs: int, grammars: GrammarBackend | None = None) -> None:
        """The caps (``max_*``) are the engine's settings (``EngineConfig``)."""
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_stop_strings = max_stop_strings
        self.max_stop_string_length = max_stop_string_length
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)
        self.grammars = grammars

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """The prompt's token ids (its last ``truncate_prompt_tokens`` only, when set) and its output budget
        (max_tokens clamped to the room left in the context). A truncated prompt's text is dropped: it no longer
        matches the token ids (echo decodes them instead)."""
        for name, value in (("n", params.n), ("best_of", params.best_of)):  # n first: best_of defaults to it
            if value > self.max_num_seqs:
                raise ParameterError(f"{name} ({value}) must not exceed this server's max_num_seqs "
                                     f"({self.max_num_seqs})", name)
        self._check_params(params)
        text, token_ids = self._tokenize(prompt)
        keep = self._truncation(params)
        if keep is not None and len(token_ids) > keep:
            text, token_ids = None, token_ids[-keep:]
        self._check_prompt(token_ids)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._check_budget(max_tokens, room, params)
        return ProcessedPrompt(text, token_ids, max_tokens)

    def check(self, processed: ProcessedPrompt, params: SamplingParams) -> None:
        """Re-check a processed prompt against this engine: what a step could not run raises ``ParameterError``.

        n / best_of are not held against max_num_seqs here: the limit may have been lowered since the
        request was accepted, and the scheduler serves such a group on its own (never refuses it late).
        """
        params.validate()
        self._check_params(params)
        self._check_prompt(processed.token_ids)
        self._check_budget(processed.max_tokens, self.max_model_len - len(processed.token_ids), params)

    def engine_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` as the engine runs them: a top_k at or beyond the vocabulary is no filter (as vLLM),
        so no step ever sees a top_k that overflows its int64 tensors; ``bad_words`` become token id
        sequences (``bad_words_token_ids``) for the sampler. A copy, never the caller's object."""
        changes = {}
        if params.top_k >= self.vocab_size:
            changes["top_k"] = 0
        if params.bad_words and params.bad_words_token_ids is None:
            changes["bad_words_token_ids"] = self.bad_words_token_ids(params.bad_words)
        return dataclasses.replace(params, **changes) if changes else params

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's reading of ``bad_words``: each word tokenized as it starts a text and after a space (the
        same word is a different token sequence mid-sentence), without special tokens; duplicates dropped.
        The sampler blocks a sequence's last token once the output ends with the tokens before it."""
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences.setdefault(ids)
        return [list(ids) for ids in sequences]

    def _truncation(self, params: SamplingParams) -> int | None:
        """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (-1: as many as fit with one
        output token, max_model_len - 1, as vLLM); None: the whole prompt."""
        k = params.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return self.max_model_len - 1
        if k < 1:
            raise ParameterError(f"truncate_prompt_tokens must be -1 or at least 1, got {k}",
                                 "truncate_prompt_tokens", INVALID_VALUE)
        return k

    def _check_params(self, params: SamplingParams) -> None:
        check_logprobs(params, self.max_logprobs)
        if params.allowed_token_ids is not None and not params.allowed_token_ids:
            raise ParameterError("allowed_token_ids must not be empty", "allowed_token_ids", INVALID_VALUE)
        if params.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in params.bad_words):
            raise ParameterError("bad_words must be non-blank strings", "bad_words", INVALID_VALUE)
        if params.truncate_prompt_tokens is not None:
            self._truncation(params)
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ParameterError(f"{name} token id {bad[0]} is out of range for vocabulary size "
                                     f"{self.vocab_size}", name)
        # Every stop string is matched after every token of the request: caps keep that cost bounded.
        if len(params.stop) > self.max_stop_strings:
            raise ParameterError(f"stop has {len(params.stop)} strings; this server allows at most "
                                 f"{self.max_stop_strings}", "stop")
        longest = max(params.stop, key=len, default="")
        if len(longest) > self.max_stop_string_length:
            raise ParameterError(f"stop string of {len(longest)} characters; this server allows at most "
                                 f"{self.max_stop_string_length}", "stop")
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ParameterError("structured outputs are not available on this engine", "structured_outputs")
            self.grammars.compile(params.structured_outputs)  # cached: the runner's lookup is then a hit

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ParameterError("prompt is empty: it must contain at least one token", "prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParameterError(f"prompt token id {bad[0]} is out of range for vocabulary size {self.vocab_size}",
                                 "prompt")
        if len(token_ids) >= self.max_model_len:
            raise ParameterError(f"prompt is {len(token_ids)} tokens long, but max_model_len is "
                                 f"{self.max_model_len} (prompt plus at least one output token must fit)", "prompt")

    @staticmethod
    def _check_budget(max_tokens: int, room: int, params: SamplingParams) -> None:
        """The resolved output cap fits the context, and so do the tokens min_tokens forces."""
        if not 1 <= max_tokens <= room:
            raise ParameterError(f"max_tokens ({max_tokens}) must be in [1, {room}], the room left in the "
                                 "context after the prompt", "max_tokens")
        if params.min_tokens > room:
            raise ParameterError(f"min_tokens ({params.min_tokens}) exceeds the room left in the context after "
                                 f"the prompt ({room} tokens)", "min_tokens")

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._as_ids(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ParameterError("a dict prompt needs 'prompt' (a string) or 'prompt_token_ids'", "prompt")
        if isinstance(prompt, list):
            return None, self._as_ids(prompt)
        raise ParameterError(f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}",
                             "prompt")

    def _encode(self, text: str) -> list[int]:
        check_prompt_chars(text, self.max_prompt_chars)
        return self.tokenizer.encode(text)

    @staticmethod
    def _as_ids(ids) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ParameterError("prompt_token_ids must be a list of integers", "prompt")
        return list(ids)
