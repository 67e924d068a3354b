"""An n-gram proposer stand-in for tests: drafts from known continuations, some spoiled on purpose."""
from __future__ import annotations


def oracle_ngram(reference_sequences: list[list[int]]):
    """An n-gram proposer stand-in that knows the reference continuations and spoils every
    third proposal's second draft: acceptance and rejection at known places. (The random tiny
    model never repeats itself, so real n-gram drafts would all be rejected.)"""
    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        for sequence in reference_sequences:
            if sequence[:len(token_ids)] == token_ids:
                drafts = sequence[len(token_ids):len(token_ids) + limit]
                if len(token_ids) % 3 == 0 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 49152
                return drafts
        return []
    return propose
