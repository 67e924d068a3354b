"""One request's constraint state: an xgrammar matcher that follows the request's output tokens.

The model runner owns it (in the request's ``CachedRequest``) and keeps it in step with the token history
it already keeps exact: before a sampling step ``sync`` feeds the matcher the output tokens it has not seen;
a history rewritten at some position (``rewind``) rolls the matcher back to there first. So a preempted
request (its history is kept), a forked sequence (built from its own history) and a request whose state was
dropped after a failed step (rebuilt from the scheduler's copy) all get the right state without special cases.

Constrained region: every output token, or, with ``start_after`` (a reasoning parser's end marker, e.g. the
tokens of ``</think>``), the output tokens after the first occurrence of that sequence; before it no mask.

Speculative steps: ``fill_speculative`` walks the drafts through the matcher, filling the mask of each
verified position, then rolls them back; a draft the grammar refuses masks itself out (the rejection sampler
then rejects it), and positions after it are never used. The accepted tokens arrive by ``sync`` next step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class RequestGrammar:
    matcher: object  # xgrammar.GrammarMatcher
    start_after: tuple[int, ...] = ()
    accepted: list[int] = field(default_factory=list)  # constrained tokens the matcher has taken
    start: int | None = None  # history position where the constrained region begins (None: not yet)
    scanned: int = 0  # history positions searched for ``start_after``
    failed: bool = False  # the matcher refused a token of the history: only stop tokens are allowed now

    def rewind(self, position: int) -> None:
        """The history changed at ``position``: forget what the matcher took from there on (and a refusal
        there: a refused token is never taken, so the matcher itself is still sound)."""
        if self.start is not None:
            end = self.start + len(self.accepted)  # the first history position not taken
            if position < self.start:
                self.matcher.reset()
                self.accepted, self.start, self.failed = [], None, False
            elif position <= end:
                if position < end:
                    self.matcher.rollback(end - position)
                    del self.accepted[position - self.start:]
                self.failed = False
        self.scanned = min(self.scanned, position)

    def sync(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Feed the matcher the constrained tokens of ``token_ids`` (prompt + output) it has not taken."""
        if self.failed or (self.start is None and not self._find_start(token_ids, num_prompt_tokens)):
            return
        for token_id in token_ids[self.start + len(self.accepted):]:
            if self.matcher.is_terminated():
                return  # a stop token ended the grammar: the request finishes at this token
            if not self.matcher.accept_token(token_id):
                logger.warning("structured output: the grammar refused token %d of the history; only stop "
                               "tokens are allowed from here", token_id)
                self.failed = True
                return
            self.accepted.append(token_id)

    @property
    def active(self) -> bool:
        """A mask applies to the next token (the constrained region has begun)."""
        return self.start is not None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into ``bitmask[row]``."""
        if self.failed or self.matcher.is_terminated():  # ended (a stop token with ignore_eos): stop tokens only
            _only_stop_tokens(bitmask, row, self.matcher.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_speculative(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Masks for the k + 1 verified positions of ``drafts`` into rows ``first_row ..``; the matcher ends
        where it began."""
        taken = 0
        for j in range(len(drafts) + 1):
            self.fill(bitmask, first_row + j)
            if j == len(drafts) or self.failed or self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(drafts[j]):
                break  # this draft is masked out at row j: nothing after it can be accepted
            taken += 1
        if taken:
            self.matcher.rollback(taken)

    def _find_start(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        if not self.start_after:
            self.start = num_prompt_tokens
            return True
        n = len(self.start_after)
        first = max(num_prompt_tokens, self.scanned - n + 1)
        for i in range(first, len(token_ids) - n + 1):
            if tuple(token_ids[i:i + n]) == self.start_after:
                self.start = i + n
                return True
        self.scanned = len(token_ids)
        return False


def _only_stop_tokens(bitmask: torch.Tensor, row: int, stop_token_ids) -> None:
    bitmask[row] = 0
    for token_id in stop_token_ids:
        bit = 1 << (token_id % 32)
        bitmask[row, token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32: bit 31 is the sign
