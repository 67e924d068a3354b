"""What the engine hands back: vLLM-shaped request outputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One position: token id -> its Logprob (the chosen token first, then the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    # Streaming: what this step added.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingOutput:
    """A pooling request's vector (``--runner pooling``): pooled, truncated to its ``dimensions`` and normalised
    as its ``PoolingParams`` say, in float32."""
    data: list[float]


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``LLM.embed`` result for one prompt (``outputs.embedding``)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # finished: the n best; while streaming: the sequences that moved
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # Set (with finished) when the engine failed this request alone, e.g. a step it was part of raised
    # or it can never fit the KV cache; the message is safe to show the client. Other requests go on.
    error: str | None = None
    # A pooling request's result (finished, ``outputs`` empty); None for a generation request.
    pooling: PoolingOutput | None = None
