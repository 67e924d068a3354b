"""What the model runner keeps of each request between steps; it never sees the scheduler's ``Request``.

The scheduler sends a request's full data once (``NewRequestData``: tokens so far,
sampling parameters) the first step it is scheduled, and after that only what
changed: the step's input tokens, and its block table's new tail. The runner writes
those in, and appends the tokens it samples itself (accepted drafts included), so
its copy of the token history stays exact without anything being resent.

Per-row numpy arrays (block tables, sampling parameters) live here for the whole
life of a request, so a step's batch and sampling tensors are fancy-indexed out of
them instead of rebuilt from Python objects. A row is freed when its request
finishes; a preempted request keeps its row (and its generator's state).

``add`` is all or nothing (a request whose parameters cannot be set up, e.g. a seed out of
range, takes no row), and ``check_invariants`` says whether the rows still add up after a
step failed half way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from paged_runtime.core.scheduler_output import NewRequestData
from paged_runtime.pooling_params import PoolingParams
from paged_runtime.sampling_params import SamplingParams, sequence_seed
from paged_runtime.structured_output.backend import GrammarBackend
from paged_runtime.structured_output.grammar import RequestGrammar


@dataclass(slots=True)
class OutputCounts:
    """For penalties: every token id the request has seen (prompt or output) and its count in the output,
    kept up to date token by token (a step costs its new tokens, not the history)."""
    token_ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)

    def add(self, token_id: int, count: int) -> None:
        i = self.index.get(token_id)
        if i is None:
            self.index[token_id] = len(self.token_ids)
            self.token_ids.append(token_id)
            self.counts.append(count)
        else:
            self.counts[i] += count


@dataclass(slots=True, eq=False)
class CachedRequest:
    request_id: str
    row: int
    token_ids: list[int]  # prompt + output, as far as the runner knows
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None  # a seeded sampled request's, on the device (the speculative paths draw from it)
    output_counts: OutputCounts | None  # only when the request has penalties
    grammar: RequestGrammar | None = None  # only when the request's output is constrained
    blocked: torch.Tensor | None = None  # [V] bool on the device, True off allowed_token_ids; None: no such list
    pooling: PoolingParams | None = None  # a pooling request: pooled, never sampled
    # MEAN pooling: float32 sum of the prompt rows computed so far; CLS: the first prompt row (float32), kept until
    # the prompt's last chunk
    pool_partial: torch.Tensor | None = None
    lora_id: int = 0  # the adapter its rows run with (0: the base model)
    # The sampler's per-step seed of a seeded row: a CPU generator seeded as ``generator`` (that one itself on the
    # CPU), so a step draws it without a device read.
    host_generator: torch.Generator | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def write_tokens(self, start: int, token_ids: list[int]) -> None:
        """Tokens at positions ``start ..``: overwrite what the runner had there (the scheduler's word
        wins, e.g. a beam's chosen token), append the rest."""
        known = len(self.token_ids)
        for position, token_id in enumerate(token_ids, start):
            if position < known:
                if self.token_ids[position] != token_id:
                    if self.grammar is not None:
                        self.grammar.rewind(position)
                    self._count(self.token_ids[position], position, -1)
                    self.token_ids[position] = token_id
                    self._count(token_id, position, 1)
            else:
                self.token_ids.append(token_id)
                self._count(token_id, position, 1)

    def _count(self, token_id: int, position: int, count: int) -> None:
        if self.output_counts is not None and position >= self.num_prompt_tokens:
            self.output_counts.add(token_id, count)


class RequestStates:
    def __init__(self, max_blocks_per_request: int, vocab_size: int, device: torch.device,
                 grammars: GrammarBackend | None = None, samples: bool = True) -> None:
        """``samples``: False on a rank that never samples, which skips the requests' output constraints."""
        self.requests: dict[str, CachedRequest] = {}
        self.num_pooling = 0  # requests that pool (``has_pooling``)
        self.samples = samples
        self.grammars = grammars
        self.device, self.vocab_size = device, vocab_size
        self.free_rows: list[int] = []
        self.block_tables = np.zeros((0, max_blocks_per_request), np.int32)
        self.num_blocks = np.zeros(0, np.int64)
        self.temperature = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, np.int64)  # vocab size = off
        self.top_p = np.zeros(0, np.float32)
        self.min_p = np.zeros(0, np.float32)

    @property
    def has_pooling(self) -> bool:
        """Some request here pools (checked per step: a generate-only batch does no pooling work)."""
        return self.num_pooling > 0

    def __getitem__(self, request_id: str) -> CachedRequest:
        return self.requests[request_id]

    def add(self, new: NewRequestData) -> CachedRequest:
        """The runner's state of a new request; raises, taking no row, if its parameters cannot be set up."""
        p = new.params
        generator = host_generator = None
        if p.seed is not None and not p.greedy:  # a forked child i draws from seed + i (wrapped, never overflows)
            seed = sequence_seed(p.seed, new.index)
            generator = host_generator = torch.Generator(device=self.device).manual_seed(seed)
            if self.device.type != "cpu":
                host_generator = torch.Generator().manual_seed(seed)
        counts = OutputCounts() if p.has_penalties else None
        state = CachedRequest(new.request_id, -1, [], new.num_prompt_tokens, p, new.eos_token_ids, generator, counts,
                              grammar=self._grammar(p), blocked=self._blocked(p.allowed_token_ids),
                              pooling=new.pooling,
                              lora_id=new.lora_request.lora_int_id if new.lora_request is not None else 0,
                              host_generator=host_generator)
        if counts is not None:
            for token_id in dict.fromkeys(new.token_ids[:new.num_prompt_tokens]):
                counts.add(token_id, 0)
        state.write_tokens(0, new.token_ids)
        # Converted before a row is taken: a value the arrays cannot hold raises here, changing nothing.
        values = (np.float32(p.temperature), np.int64(p.top_k or self.vocab_size), np.float32(p.top_p),
                  np.float32(p.min_p))
        state.row = row = self.free_rows.pop() if self.free_rows else self._grow()
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = values
        self.num_blocks[row] = 0
        self.requests[new.request_id] = state
        self.num_pooling += new.pooling is not None
        return state

    def _grammar(self, p: SamplingParams) -> RequestGrammar | None:
        """A fresh matcher for a constrained request (its history is fed at its first sampling step)."""
        constraint = p.structured_outputs
        if constraint is None or not self.samples:
            return None
        if self.grammars is None:
            raise ValueError("structured_outputs needs a grammar backend; this runner has none")
        matcher = self.grammars.matcher(self.grammars.compile(constraint))
        return RequestGrammar(matcher, tuple(constraint.after_token_ids or ()))

    def _blocked(self, allowed_token_ids: list[int] | None) -> torch.Tensor | None:
        """The tokens outside ``allowed_token_ids`` (built once per request, stacked per step)."""
        if allowed_token_ids is None:
            return None
        blocked = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
        blocked[torch.tensor(allowed_token_ids, dtype=torch.long, device=self.device)] = False
        return blocked

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.free_rows.append(state.row)
            self.num_pooling -= state.pooling is not None

    def retain(self, request_ids) -> list[str]:
        """Drop every request not in ``request_ids`` (after a failed step); the ids dropped."""
        dropped = [request_id for request_id in self.requests if request_id not in request_ids]
        for request_id in dropped:
            self.remove(request_id)
        return dropped

    def check_invariants(self) -> None:
        """Every row is either one request's or free, never both, never twice."""
        rows = [state.row for state in self.requests.values()]
        assert len(set(rows)) == len(rows), "two requests share a row"
        assert not set(rows) & set(self.free_rows), "a request's row is also free"
        assert sorted(rows + self.free_rows) == list(range(len(self.temperature))), "a row is lost"

    def update_blocks(self, state: CachedRequest, first: int, block_ids: list[int]) -> None:
        """The request's table becomes its first ``first`` blocks followed by ``block_ids``."""
        end = first + len(block_ids)
        table = self.block_tables[state.row]
        table[first:end] = block_ids
        table[end:self.num_blocks[state.row]] = 0
        self.num_blocks[state.row] = end

    def block_ids(self, state: CachedRequest) -> np.ndarray:
        return self.block_tables[state.row, :self.num_blocks[state.row]]

    def _grow(self) -> int:
        """One more row in every array (doubling their capacity when full); returns the new row."""
        row = len(self.temperature)  # called only when every row is taken
        capacity = max(16, 2 * len(self.temperature))
        grow = lambda a: np.concatenate([a, np.zeros((capacity - len(a), *a.shape[1:]), a.dtype)])
        for name in ("block_tables", "num_blocks", "temperature", "top_k", "top_p", "min_p"):
            setattr(self, name, grow(getattr(self, name)))
        self.free_rows.extend(range(capacity - 1, row, -1))
        return row
