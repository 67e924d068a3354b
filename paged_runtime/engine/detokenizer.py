"""Incremental detokenization and stop strings, one request at a time.

Text grows by decoding a short window of trailing tokens: the new text is
``decode(window + new) - decode(window)``. A piece that ends in U+FFFD (an
incomplete multi-byte character) is held until the next token completes it,
so streamed text is always valid and the concatenation of all deltas equals
the final text. The window starts with the last prompt tokens so
tokenizers that mark word starts on the token itself keep their spaces.

Stop strings: one compiled pattern per request (all strings as alternatives)
searched over the new text plus the ``longest - 1`` characters before it, the
only place a new match can be (an older one would have stopped the request
already). A step costs its new text plus that window, whatever the length of
the text so far. The earliest match in the text wins; at the same position,
the string listed first.
"""
from __future__ import annotations

import re
from functools import lru_cache

from paged_runtime.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5


@lru_cache(maxsize=256)
def _stop_pattern(stop: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(map(re.escape, stop)))


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_sent_chars = 0
        # Streaming holds back text that could still become a stop string.
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        self.holdback = max(self.longest_stop, 1) - 1
        self.stop_pattern = _stop_pattern(tuple(params.stop)) if params.stop else None

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens' text; returns the stop string if one now occurs (text is then cut)."""
        start = len(self.text)
        for token_id in token_ids:
            self._add_token(token_id)
        return self._find_stop(start)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens)

    def _add_token(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _find_stop(self, start: int) -> str | None:
        if self.stop_pattern is None or len(self.text) == start:
            return None
        match = self.stop_pattern.search(self.text, max(0, start - self.longest_stop + 1))
        if match is None:
            return None
        stop = match.group()
        self.text = self.text[:match.end() if self.params.include_stop_str_in_output else match.start()]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, the tail that may start a stop string stays back."""
        end = len(self.text) if finished or not self.params.stop else max(0, len(self.text) - self.holdback)
        end = max(end, self.num_sent_chars)
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta
