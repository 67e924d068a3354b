"""A request as the scheduler sees it: token ids and counters, no tensors.

Token layout of a request (``num_tokens = len(all_token_ids)``)::

    |<------------- prompt ------------->|<----- output ----->|
    |<-- num_computed_tokens (KV cached) -->|<- to compute ->|

Every step the scheduler picks how many of the uncomputed tokens to run;
the token sampled after the last one is appended and is itself uncomputed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from paged_runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # monotone admission order; later arrivals are preempted first
    max_tokens: int  # resolved output cap (params.max_tokens clipped to the model length)
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    block_hashes: list[bytes] = field(default_factory=list)  # of each full block of all_token_ids

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
