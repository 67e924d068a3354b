"""What the scheduler hands the model runner each step: request ids, token counts, the input tokens
and block-table changes, and a request's full data only the first time it is scheduled.

The runner keeps everything else itself (``worker/request_states.py``); nothing downstream of the
scheduler holds or mutates its ``Request`` objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from paged_runtime.lora.request import LoRARequest
from paged_runtime.pooling_params import PoolingParams
from paged_runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (new, or a forked sibling): its tokens so far and how to sample."""
    request_id: str
    token_ids: list[int]  # prompt + output so far (a copy)
    num_prompt_tokens: int
    params: SamplingParams
    index: int  # the sequence's index in its parallel-sampling group: its seed is params.seed + index
    eos_token_ids: frozenset[int]
    pooling: PoolingParams | None = None  # a pooling request: the runner pools its prompt, never samples
    lora_request: LoRARequest | None = None  # the adapter its rows run with


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    start: int  # first position computed this step (num_computed_tokens at schedule time)
    num_new_tokens: int  # the request's own tokens computed this step
    token_ids: list[int]  # those tokens (positions start .. start + num_new_tokens - 1)
    samples: bool  # the step reaches the request's last token: sample its next one
    # Speculative drafts verified after the request's last token (slots reserved for them).
    # n-gram drafts are known at scheduling; a draft model's are filled in by the runner.
    num_spec: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    # The runner's block table for the request becomes table[:first] + ids (None: unchanged).
    block_ids_update: tuple[int, list[int]] | None = None
    new_request: NewRequestData | None = None  # the first time the runner sees the request

    @property
    def num_scheduled(self) -> int:
        return self.num_new_tokens + self.num_spec


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    num_preempted: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy before the forward
    # Requests that left the engine since the last step: the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled
