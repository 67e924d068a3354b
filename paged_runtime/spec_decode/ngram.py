"""Prompt-lookup (n-gram) proposer: continue the longest earlier repeat of the sequence's tail.

For n from ``max_n`` down to ``min_n``: if the last n tokens occurred earlier in
the request's tokens (prompt and output), propose the tokens that followed
their most recent earlier occurrence. One vectorised pass per n over the
sequence: linear time per request.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to ``limit`` draft tokens (possibly none) continuing ``token_ids``."""
        if limit <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that start before the tail itself; window i is followed by tokens[i + n].
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start:start + limit].tolist()
        return []
