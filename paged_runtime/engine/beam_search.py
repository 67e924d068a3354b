"""Beam search inside the engine, with transformers' semantics.

Each live beam is a request. All beams of a search step together: a beam
that received its token pauses (the token is only a placeholder) until every
live beam of its search has its top-K raw logprobs; then one round of
transformers' algorithm picks the next beams. A kept beam continues as is, a
beam that several candidates extend is forked (blocks shared, copy-on-write
tail), and a beam nobody extends is finished at once, freeing its private
blocks in the same step.

The round mirrors ``GenerationMixin._beam_search`` (float32 scores, top
``max(2, 1 + #eos) * beam_width`` candidates, stopping criteria, finished
hypotheses scored ``sum logprob / generated_len ** length_penalty`` and the
same early-stop heuristic), so greedy results equal ``generate(num_beams=k,
do_sample=False, length_penalty=..., early_stopping=...)``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from paged_runtime.engine.core import EngineCore
from paged_runtime.request import Request, RequestStatus
from paged_runtime.sampling_params import SamplingParams

_NEG = -1.0e9


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be in [1, 10], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # generated tokens (EOS included when it ended the beam)
    score: float  # cumulative logprob / generated length ** length_penalty
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _Search:
    """One prompt's beam search, as transformers keeps it (batch size 1)."""
    prompt: list[int]
    params: BeamSearchParams
    eos: frozenset[int]
    beams: list[Request]  # live beams, in running order
    scores: torch.Tensor  # [len(beams)] float32 running scores
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # (score, tokens), best first
    heuristic_unsatisfied: bool = True
    cur_len: int = 0
    max_length: int = 0  # prompt + max_tokens, as transformers' max_length
    done: bool = False

    @property
    def beams_to_keep(self) -> int:
        return max(2, 1 + len(self.eos)) * self.params.beam_width


class BeamSearchDriver:
    def __init__(self, core: EngineCore, eos_token_ids: frozenset[int]) -> None:
        self.core = core
        self.eos_token_ids = eos_token_ids
        self._ids = itertools.count()
        self._pending: dict[str, tuple[list[int], list[float]]] = {}  # beam id -> its top-K this round

    def run(self, prompts: list[list[int]], params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
        searches = [self._start(p, params) for p in prompts]
        try:
            while not all(s.done for s in searches):
                self._step(searches)
        finally:
            self.core.finish_requests([b.request_id for s in searches for b in s.beams], RequestStatus.FINISHED_ABORTED)
        return [[BeamSearchSequence(tokens, score) for score, tokens in s.finished[:params.beam_width]]
                for s in searches]

    def _start(self, prompt: list[int], params: BeamSearchParams) -> _Search:
        room = self.core.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(f"prompt is {len(prompt)} tokens long, but max_model_len is {self.core.max_model_len}")
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        search = _Search(prompt, params, eos, [], torch.zeros(1), cur_len=len(prompt),
                         max_length=len(prompt) + min(params.max_tokens, room))
        # The engine never stops a beam itself: the driver decides (EOS and length are its criteria).
        sampling = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=search.beams_to_keep)
        beam = Request(f"beam-{next(self._ids)}", prompt, sampling, next(self._ids), room + 1, speculative=False)
        self.core.add_request(beam)
        search.beams.append(beam)
        return search

    def _step(self, searches: list[_Search]) -> None:
        """One engine step; then a round for every search whose live beams all have a token."""
        candidates: dict[str, tuple[list[int], list[float]]] = {}
        for update in self.core.step(sync=True):
            if update.logprobs is not None:
                update.request.paused = True
                candidates[update.request.request_id] = (update.logprobs.top_ids, update.logprobs.top_logprobs)
        self._pending.update(candidates)
        for search in searches:
            if not search.done and all(b.request_id in self._pending for b in search.beams):
                self._round(search, [self._pending.pop(b.request_id) for b in search.beams])

    def _round(self, s: _Search, tops: list[tuple[list[int], list[float]]]) -> None:
        k, width = s.beams_to_keep, s.params.beam_width
        # Global top-K over (beam, token) of running score + logprob: each beam's own top-K suffices.
        flat = [(s.scores[b] + torch.tensor(lp, dtype=torch.float32), b, ids) for b, (ids, lp) in enumerate(tops)]
        totals = torch.cat([t for t, _, _ in flat])
        owners = [(b, token) for _, b, ids in flat for token in ids]
        top_scores, top_index = totals.topk(min(k, totals.numel()))
        chosen = [owners[i] for i in top_index.tolist()]
        max_length = s.max_length
        hits = torch.tensor([t in s.eos or s.cur_len + 1 >= max_length for _, t in chosen])
        self._update_finished(s, chosen, top_scores, hits)
        running_scores = top_scores + hits.float() * _NEG
        keep_scores, keep = running_scores.topk(min(width, len(chosen)))
        s.cur_len += 1
        self._check_heuristic(s, keep_scores, max_length)
        s.done = not (s.heuristic_unsatisfied and not (len(s.finished) == width and s.params.early_stopping is True)
                      and not bool(hits.all()))
        self._advance(s, [chosen[i] for i in keep.tolist()], keep_scores, done=s.done)

    def _update_finished(self, s: _Search, chosen, top_scores: torch.Tensor, hits: torch.Tensor) -> None:
        width = s.params.beam_width
        gen_len = s.cur_len + 1 - len(s.prompt)
        normalized = top_scores / (gen_len ** s.params.length_penalty)
        if len(s.finished) == width and s.params.early_stopping is True or not s.heuristic_unsatisfied:
            return
        for rank, ((beam, token), score, hit) in enumerate(zip(chosen, normalized.tolist(), hits.tolist())):
            if hit and rank < width:
                tokens = s.beams[beam].output_token_ids[:-1] + [token]
                s.finished.append((score, tokens))
        s.finished = sorted(s.finished, key=lambda f: f[0], reverse=True)[:width]

    @staticmethod
    def _check_heuristic(s: _Search, running_scores: torch.Tensor, max_length: int) -> None:
        if len(s.finished) < s.params.beam_width:
            return  # an open slot always counts as improvable
        lp = s.params.length_penalty
        best_len = (max_length if s.params.early_stopping == "never" and lp > 0 else s.cur_len) - len(s.prompt)
        best_running = float(running_scores[0]) / (best_len ** lp)
        s.heuristic_unsatisfied = s.heuristic_unsatisfied and best_running > s.finished[-1][0]

    def _advance(self, s: _Search, kept: list[tuple[int, int]], scores: torch.Tensor, done: bool) -> None:
        """Turn the kept (parent beam, token) pairs into the next live beams; free the rest."""
        parents = s.beams
        alive = [] if done else [(b, t, sc) for (b, t), sc in zip(kept, scores.tolist()) if sc > _NEG / 2]
        reused: set[int] = set()
        beams, new_scores = [], []
        for parent_index, token, score in alive:
            parent = parents[parent_index]
            if parent_index in reused:
                beam = self.core.scheduler.fork_request(parent, f"beam-{next(self._ids)}")
            else:
                beam = parent
                reused.add(parent_index)
            beams.append((beam, token))
            new_scores.append(score)
        # Tokens are set after every fork so that forks copy the parent's untouched placeholder.
        for beam, token in beams:
            beam.replace_last_token(token, self.core.kv_cache.block_size)
            beam.paused = False
        dropped = [p.request_id for i, p in enumerate(parents) if i not in reused]
        self.core.finish_requests(dropped, RequestStatus.FINISHED_ABORTED)
        s.beams = [b for b, _ in beams]
        s.scores = torch.tensor(new_scores, dtype=torch.float32)
