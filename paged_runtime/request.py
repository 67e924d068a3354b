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

from paged_runtime.lora.request import LoRARequest
from paged_runtime.pooling_params import PoolingParams
from paged_runtime.sampling_params import SamplingParams


def child_request_id(group_id: str, index: int) -> str:
    """Internal id of parallel-sampling sequence ``index`` (0 is the group's own id). Group ids are the
    engine's own (``LLMEngine`` maps callers' ids to them), so no caller string can equal a child's id."""
    return group_id if index == 0 else f"{group_id}\x1f{index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed by the engine (never fits the cache, a step it was in raised)

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
    error: str | None = None  # why the engine failed it (status FINISHED_ERROR); safe to show the client
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    block_hashes: list[bytes] = field(default_factory=list)  # of each full block of all_token_ids
    # Parallel sampling (n / best_of): the user's request id, this sequence's index, and how many
    # siblings are still to be forked off once the prompt (all but its last token) is computed.
    group_id: str = ""
    index: int = 0
    num_pending_forks: int = 0
    # Beam search: the sampled token is a placeholder until the driver picks this beam's next
    # token; a paused request is not scheduled.
    paused: bool = False
    speculative: bool = True  # may verify draft tokens (beam search sequences may not)
    # Never start from prefix-cache hits: every prompt position is computed (prompt logprobs need
    # each one's logits). The request's own blocks are still published to the cache.
    skip_prefix_cache: bool = False
    # A pooling request (prefill only, never samples: finished once its prompt is computed). MEAN and CLS
    # pooling read rows before the last, so they never start from prefix-cache hits (``pooling_params``' rule).
    pooling: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        if not self.index:
            self.num_pending_forks = self.params.best_of - 1
        self.skip_prefix_cache = (self.skip_prefix_cache or self.params.prompt_logprobs is not None
                                  or (self.pooling is not None and self.pooling.skips_prefix_cache))

    def fork(self, index: int, request_id: str | None = None) -> Request:
        """A sibling at the same point: same tokens and computed count (its blocks are forked
        by the KV-cache manager)."""
        request_id = request_id or child_request_id(self.group_id, index)
        child = Request(request_id, self.prompt_token_ids, self.params, self.arrival,
                        self.max_tokens, self.eos_token_ids, self.prompt, self.priority, self.cache_salt,
                        group_id=self.group_id, index=index, speculative=self.speculative,
                        skip_prefix_cache=self.skip_prefix_cache, lora_request=self.lora_request)
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        return child

    @property
    def lora_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

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

    def replace_last_token(self, token_id: int, block_size: int) -> None:
        """Swap the last (not yet computed) token, dropping any block hash that covered it."""
        assert self.num_computed_tokens < self.num_tokens, "the last token's KV is already written"
        self.all_token_ids[-1] = token_id
        del self.block_hashes[(self.num_tokens - 1) // block_size:]
