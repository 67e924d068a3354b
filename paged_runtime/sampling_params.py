"""Per-request sampling and stopping parameters (names and meaning as vLLM's).

Validation happens here, once, at construction: a bad value raises
``ParameterError`` (a ``ValueError``) whose ``param`` names the field, so the
engine never sees an invalid request and the HTTP layer never re-checks what
this class checks.
"""
from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass, field

LOGIT_BIAS_LIMIT = 100.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
INVALID_VALUE = "invalid_value"  # OpenAI's error code for a value outside its field's domain
FLOAT32_MAX = 3.4028234663852886e38  # the sampler works in float32: a larger value becomes inf there
# repetition_penalty divides positive logits and multiplies negative ones: outside this range a logit
# overflows float32 (inf, then NaN probabilities) or the penalty itself rounds to 0.
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
_INT_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sequence_seed(seed: int, index: int) -> int:
    """The seed of parallel-sampling sequence ``index``: ``seed + index``, wrapped into torch's seed range.

    torch reads a seed modulo 2**64 (-1 is 2**64 - 1), so wrapping changes no stream that did not overflow.
    """
    value = seed + index
    return value if value <= SEED_MAX else value - 2**64


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request holds (vLLM's names).

    CUMULATIVE: every output carries the whole text and token ids so far (plus this step's delta fields).
    DELTA: ``text``, ``token_ids`` and ``logprobs`` hold only what this step added (streaming servers);
    the finished output is a delta too.
    FINAL_ONLY: one output, when the request finishes, with everything (non-streaming servers).
    """
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``): exactly one of the fields is set.

    ``json``: a JSON schema (dict or its JSON text); ``regex``; ``choice``: the output is one of these
    strings; ``grammar``: an EBNF grammar (xgrammar / GBNF syntax); ``json_object``: any JSON object.
    Compiled by ``paged_runtime.structured_output`` (xgrammar) when the request is processed, so an
    invalid schema, regex or grammar is a ``ParameterError`` before any compute.
    """
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_whitespace: bool = False  # JSON: free whitespace between tokens (vLLM's disable_any_whitespace=False)
    # Not part of the constraint: it applies only after the output contains these tokens (a reasoning
    # parser's end marker, e.g. ``</think>``), so a model reasons freely first. Empty: from the first token.
    after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ParameterError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                                 f"json_object; got {kinds or 'none'}", "structured_outputs", INVALID_VALUE)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ParameterError("structured_outputs choice must be a non-empty list of non-empty strings",
                                 "structured_outputs", INVALID_VALUE)

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))


class ParameterError(ValueError):
    """A request parameter that cannot be served; ``param`` names the field as clients spell it.

    ``code`` is ``"invalid_value"`` when the value alone is outside the field's domain (a negative
    temperature), and None when it clashes with another field or with the server (best_of < n, a token
    id beyond the vocabulary): the HTTP layer forwards both to the client as they are.
    """

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # generate best_of, return the n with the highest cumulative logprob
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (plus the prompt's own)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words never generated (each word's last token blocked after its prefix)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: up to max_model_len)
    # Set by the engine's processor from ``bad_words`` (each word's token ids, with and without a leading space);
    # callers leave it None.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {k: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, v)) for k, v in self.logit_bias.items()}
        self.validate()

    def _check_types(self) -> None:
        """Integers where a step indexes or counts (2.5 sequences would fail inside a step), finite float32
        numbers where the sampler computes (NaN passes every comparison-based range check)."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _as_int(name, value))
        for name in _FLOAT_FIELDS:
            setattr(self, name, _as_float32(name, getattr(self, name)))
        if self.logit_bias:
            self.logit_bias = {_as_int("logit_bias", k, "keys"): _as_float32("logit_bias", v, "values")
                               for k, v in self.logit_bias.items()}

    def validate(self) -> None:
        """Range and consistency checks (run at construction; the engine runs them again on what it is given)."""
        # (param, holds, message): range checks first, so a value is judged before its clash with others.
        low, high = REPETITION_PENALTY_RANGE
        in_range = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("best_of", self.best_of >= 1, f"best_of must be at least 1, got {self.best_of}"),
            ("temperature", self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0, f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", low <= self.repetition_penalty <= high,
             f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}"),
            ("stop", all(s for s in self.stop), "stop strings must be non-empty"),
            # The upper bound is the engine's (max_logprobs), checked by its processor.
            ("logprobs", self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be non-negative, got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}"),
        ]
        consistent = [
            ("best_of", self.best_of >= self.n, f"best_of must be at least n ({self.n}), got {self.best_of}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            # As vLLM: deltas of best_of candidates would stream text the n best may not contain.
            ("best_of", self.output_kind != RequestOutputKind.DELTA or self.best_of == self.n,
             f"best_of ({self.best_of}) must equal n ({self.n}) for delta (streamed) outputs"),
        ]
        for code, checks in ((INVALID_VALUE, in_range), (None, consistent)):
            for param, ok, message in checks:
                if not ok:
                    raise ParameterError(message, param, code)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_logprobs(self) -> bool:
        """The sampled token's logprob is needed: asked for, or to rank best_of candidates."""
        return self.logprobs is not None or self.best_of > self.n


def _as_int(name: str, value, part: str = "") -> int:
    """``value`` as an int (numpy integers too, never a float); ``part`` names what of the field it is."""
    try:
        return operator.index(value)
    except TypeError:
        raise ParameterError(f"{name}{part and ' ' + part} must be an integer, got {value!r}",
                             name, INVALID_VALUE) from None


def _as_float32(name: str, value, part: str = "") -> float:
    """``value`` as a float that is finite in float32, the sampler's precision (NaN and inf are refused)."""
    number = float(value) if isinstance(value, (int, float)) or hasattr(value, "__float__") else math.nan
    if isinstance(value, str) or not (math.isfinite(number) and abs(number) <= FLOAT32_MAX):
        raise ParameterError(f"{name}{part and ' ' + part} must be a finite number, got {value!r}",
                             name, INVALID_VALUE)
    return number
