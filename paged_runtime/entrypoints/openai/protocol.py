"""Request bodies of the OpenAI routes (OpenAI's fields plus vLLM's extras), parsed by pydantic.

The schema checks types and OpenAI's own limits that are stricter than the
runtime's (``n`` and ``best_of`` up to 128, ``temperature`` up to 2, logit
bias values within 100); every other range is ``SamplingParams``'s, checked
once when the routes build it, so no rule lives in two places.

Fields OpenAI defines but this runtime cannot honour (audio, predicted
outputs, ...) are accepted by the parser and refused by ``unsupported()`` with
a 400 that names them. vLLM's extras that would change the result and that
this runtime does not implement (``REFUSED_EXTRAS``: logits processors,
beam search, disaggregated serving, ...) are refused by ``refused_extra()``
the same way. Any other unknown field is ignored, as vLLM does, so newer
clients keep working; ``log_unknown_fields()`` names each such field once per
process at DEBUG level.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from paged_runtime.sampling_params import LOGIT_BIAS_LIMIT

logger = logging.getLogger(__name__)

TokenIds = list[StrictInt]
MAX_LOGGED_UNKNOWN_FIELDS = 256  # unknown field names remembered (and logged once each); bounded against junk
_logged_unknown_fields: set[str] = set()
MAX_N = 128  # OpenAI's limit for n
MAX_TEMPERATURE = 2.0  # OpenAI's; the runtime itself takes any non-negative temperature


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; no obfuscation field is ever sent
    continuous_usage_stats: bool | None = None  # vLLM's usage in every chunk: refused (see check_common)


def _set(value: Any) -> bool:
    return value is not None


def _true(value: Any) -> bool:
    return bool(value)


_NO_CUSTOM_CODE = "this server runs no custom code"
# vLLM's request extras that would change the result and that this runtime does not implement:
# field -> (whether its value asks for something, why it is refused). Both routes.
_REFUSED_EXTRAS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (_true, "use_beam_search is not supported on the OpenAI routes (LLM.beam_search has it)"),
    "length_penalty": (lambda v: v is not None and v != 1, "length_penalty is not supported: it only scores beam "
                                                           "search, which the OpenAI routes do not run"),
    "logits_processors": (_true, f"logits_processors are not supported: {_NO_CUSTOM_CODE}"),
    "vllm_xargs": (_true, f"vllm_xargs are not supported: {_NO_CUSTOM_CODE} that would read them"),
    "kv_transfer_params": (_set, "kv_transfer_params are not supported: this runtime does no disaggregated serving"),
    "mm_processor_kwargs": (_set, "mm_processor_kwargs are not supported: this runtime serves text-only models"),
    "return_tokens_as_token_ids": (_true, "return_tokens_as_token_ids is not supported"),
    "guided_whitespace_pattern": (_set, "guided_whitespace_pattern is not supported: set structured_outputs."
                                        "disable_any_whitespace instead"),
    "structural_tag": (_set, "structural_tag is not supported: use tools with tool_choice, or a json_schema"),
}


class SamplingFields(OpenAIModel):
    """What /v1/completions and /v1/chat/completions share: OpenAI's sampling fields and vLLM's extras.

    Unknown fields are kept (``model_extra``) only so ``refused_extra`` and ``log_unknown_fields`` can see them.
    """
    model_config = ConfigDict(extra="allow")
    REFUSED_EXTRAS: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = _REFUSED_EXTRAS
    model: str | None = None  # optional, as in vLLM: the served model when absent
    n: Annotated[int, Field(le=MAX_N)] = 1
    temperature: Annotated[float, Field(le=MAX_TEMPERATURE)] | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # The runtime clamps a bias to the limit; OpenAI refuses one beyond it.
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Structured outputs: vLLM's field (json / regex / choice / grammar / json_object) and its older spellings.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("cache_salt must be a non-empty string")
        return value

    def refused_extra(self) -> tuple[str, str] | None:
        """(param, message) of the first vLLM extra this request sets that this runtime refuses, or None."""
        extras = self.model_extra or {}
        return next(((name, message) for name, (asks, message) in self.REFUSED_EXTRAS.items()
                     if name in extras and asks(extras[name])), None)

    def log_unknown_fields(self) -> None:
        """Name each unknown field once per process (DEBUG): ignored, as vLLM does, but not in silence."""
        for name in (self.model_extra or {}).keys() - self.REFUSED_EXTRAS.keys() - _logged_unknown_fields:
            if len(_logged_unknown_fields) >= MAX_LOGGED_UNKNOWN_FIELDS:
                return
            _logged_unknown_fields.add(name)
            logger.debug("request field %r is not known to this server and is ignored", name[:100])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    best_of: Annotated[int, Field(le=MAX_N)] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    REFUSED_EXTRAS = {
        **_REFUSED_EXTRAS,
        "prompt_embeds": (_set, "prompt_embeds are not supported: send the prompt as text or token ids"),
        "add_special_tokens": (lambda v: v is False, "add_special_tokens false is not supported: the prompt is "
                                                     "tokenized with the model's special tokens (or send token ids)"),
    }

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field this runtime cannot honour, or None."""
        if self.suffix is not None:
            return "suffix", "suffix is not supported: this runtime does not do fill-in-the-middle"
        return None


class TextContentPart(OpenAIModel):
    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # reaches the chat template (models that read it), as in vLLM
    # vLLM's chat extras
    include_reasoning: bool = True  # with --reasoning-parser: False drops reasoning_content
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    REFUSED_EXTRAS = {
        **_REFUSED_EXTRAS,
        "best_of": (lambda v: v is not None and v != 1, "best_of is not supported on chat completions "
                                                        "(use /v1/completions)"),
        "echo": (_true, "echo is not supported on chat completions"),
        "add_special_tokens": (_true, "add_special_tokens true is not supported: the chat template adds the "
                                      "special tokens"),
        "documents": (_true, "documents are not supported: this runtime passes no documents to chat templates"),
        "chat_template": (_set, "a per-request chat_template is not accepted: start the server with "
                                "--chat-template"),
    }

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field this runtime cannot honour, or None."""
        deprecated = "is OpenAI's deprecated spelling and not supported: use tools and tool_choice"
        checks = [
            ("functions", bool(self.functions), f"functions {deprecated}"),
            ("function_call", self.function_call not in (None, "none", "auto"), f"function_call {deprecated}"),
            ("audio", self.audio is not None, "audio output is not supported: this model only writes text"),
            ("modalities", any(m != "text" for m in self.modalities or []),
             "only the 'text' modality is supported"),
            ("prediction", self.prediction is not None, "predicted outputs are not supported"),
            ("web_search_options", self.web_search_options is not None, "web search is not supported"),
        ]
        return next(((param, message) for param, ok, message in checks if ok), None)


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: either ``prompt`` or chat ``messages``."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


class ModelNameRequest(OpenAIModel):
    """llama.cpp's POST /models/load and /models/unload (a server of several models)."""
    model: str | None = None


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's POST /v1/load_lora_adapter (``base_model_name``: on a server of several models, the base)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's POST /v1/unload_lora_adapter."""
    lora_name: str = Field(min_length=1)


# ---- POST /v1/responses -------------------------------------------------------------------------------------
MAX_METADATA_PAIRS = 16  # OpenAI's limits on a response's metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class ResponseTextFormat(OpenAIModel):
    """``text.format``: text, json_object, or json_schema (the schema's fields flat, unlike chat's)."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(OpenAIModel):
    format: ResponseTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # echoed; the chat template decides length


class ResponseReasoningConfig(OpenAIModel):
    effort: str | None = None  # reaches the chat template as reasoning_effort, as chat's does
    summary: str | None = None  # no summaries are written: reasoning items carry the reasoning text itself
    generate_summary: str | None = None


class ResponsesTool(OpenAIModel):
    """One of ``tools``: the flat function shape ``{"type": "function", "name", "parameters", ...}``; any
    other type (web_search, file_search, mcp, ...) parses here and is refused by the route, naming it."""
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Metadata = dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]]


class ResponsesRequest(SamplingFields):
    """OpenAI's Responses request (vLLM's extras too: the sampling fields of ``SamplingFields``). Input items
    stay plain dicts here: ``serving_responses`` reads them into chat messages, naming the item it refuses."""
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    background: bool | None = False
    text: ResponseTextConfig | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ResponseReasoningConfig | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    metadata: Annotated[Metadata, Field(max_length=MAX_METADATA_PAIRS)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    # vLLM's extra
    chat_template_kwargs: dict[str, Any] | None = None
    REFUSED_EXTRAS = ChatCompletionRequest.REFUSED_EXTRAS

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field this runtime cannot honour, or None."""
        checks = [
            ("n", self.n != 1, "n is not a Responses field: a response has one output"),
            ("background", bool(self.background and self.stream),
             "background responses cannot be streamed here: create it, then poll GET /v1/responses/{id}"),
            ("background", bool(self.background and self.store is False), "a background response must be stored: "
                                                                          "set store to true"),
            ("conversation", self.conversation is not None,
             "conversations are not supported: chain responses with previous_response_id"),
            ("prompt", self.prompt is not None, "prompt templates are not supported: send input and instructions"),
            ("context_management", bool(self.context_management), "context_management is not supported"),
            ("truncation", self.truncation == "auto",
             "truncation 'auto' is not supported: a conversation longer than the context is refused"),
            ("max_tool_calls", self.max_tool_calls is not None, "max_tool_calls is not supported: use "
                                                                "parallel_tool_calls false for at most one call"),
            ("top_logprobs", bool(self.top_logprobs), "top_logprobs are not supported on /v1/responses (chat "
                                                      "completions have them)"),
            ("include", "message.output_text.logprobs" in (self.include or ()),
             "output_text logprobs are not supported on /v1/responses (chat completions have them)"),
        ]
        return next(((param, message) for param, ok, message in checks if ok), None)


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings: OpenAI's fields, and vLLM's ``normalize``, ``priority`` and ``cache_salt`` extras."""
    input: str | list[str] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    normalize: bool | None = None
    priority: int = 0
    cache_salt: str | None = None
