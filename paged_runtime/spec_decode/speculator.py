"""What the scheduler asks of speculative decoding: the drafts to verify for one request.

Only plain decodes speculate. Requests whose logits change with every
preceding token in ways the verification pass does not replay (penalties,
min_tokens still pending, logit bias, allowed_token_ids, bad_words) and beam-search sequences decode one
token at a time beside the speculating ones in the same batch.
"""
from __future__ import annotations

from paged_runtime.request import Request
from paged_runtime.spec_decode.config import SpeculativeConfig
from paged_runtime.spec_decode.ngram import NgramProposer


def can_speculate(request: Request) -> bool:
    p = request.params
    return (request.speculative and not p.has_penalties and not p.logit_bias
            and p.allowed_token_ids is None and not p.bad_words
            and request.num_output_tokens >= p.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.ngram = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)

    def propose(self, request: Request, limit: int) -> list[int | None]:
        """n-gram: the draft tokens themselves (maybe fewer than k, maybe none). Draft model:
        k placeholders (None) that the model runner's draft pass fills in."""
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0 or not can_speculate(request):
            return []
        if self.ngram is not None:
            return self.ngram.propose(request.all_token_ids, limit)
        return [None] * limit
