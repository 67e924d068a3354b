"""KServe's v1 and v2 inference protocols, mapped onto the runtime's completion requests.

v1  ``POST /v1/models/NAME:predict``::

        {"instances": ["plain prompt", {"prompt": "..." | [token ids], "max_tokens": 32, "temperature": 0}]}
     -> {"predictions": [{"text": "...", "finish_reason": "stop" | "length",
                          "usage": {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...}}]}

    An instance is a string or the body of an OpenAI completion request for
    one prompt and one output: the same sampling and stopping fields (vLLM's
    extras included) with the same defaults (``max_tokens`` 16, ``temperature``
    1). ``stream`` and ``n`` > 1 belong to the OpenAI routes; a field that is
    not one of these is refused rather than ignored.

v2  ``POST /v2/models/NAME/infer``: input ``text_input`` (BYTES, shape
    [batch]); request ``parameters`` hold the same fields, shared by the batch
    (``binary_data_output`` is KServe's own and is left to it) -> outputs
    ``text_output`` and ``finish_reason`` (BYTES, [batch]); response
    parameters ``prompt_tokens`` and ``completion_tokens`` for the batch.
    Over gRPC (``--enable_grpc true``) parameters can only be bools, ints
    and strings: send a float such as ``temperature`` as a string ("0.7").

Every check runs before anything is submitted, with the OpenAI routes' own
validation, so a request is refused whole; a refusal is KServe's
``InvalidInput`` (400) whose message names the instance or tensor and the field.
A request holds at most ``max_prompts_per_request`` prompts (instances or
``text_input`` elements), as a completions ``prompt`` list on the OpenAI routes.

``v1_prepare`` / ``v2_prepare`` tokenize on the calling thread: call them on
the serving object's tokenizer worker with ``on_worker=True`` (it then uses the
worker's tokenizer; ``PagedRuntimeModel.predict`` does), never on the event loop.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse, to_http_parameters
from pydantic import ConfigDict, ValidationError

from paged_runtime.engine.processor import ProcessedPrompt
from paged_runtime.entrypoints.openai.errors import OpenAIError, from_validation_error, parse_json
from paged_runtime.entrypoints.openai.protocol import SamplingFields, TokenIds
from paged_runtime.entrypoints.openai.serving import OpenAIServing
from paged_runtime.outputs import RequestOutput
from paged_runtime.sampling_params import SamplingParams

TEXT_INPUT, TEXT_OUTPUT, FINISH_REASON = "text_input", "text_output", "finish_reason"
INPUT_TYPES = [{"name": TEXT_INPUT, "datatype": "BYTES", "shape": [-1]}]
OUTPUT_TYPES = [{"name": TEXT_OUTPUT, "datatype": "BYTES", "shape": [-1]},
                {"name": FINISH_REASON, "datatype": "BYTES", "shape": [-1]}]
KSERVE_PARAMETERS = frozenset({"binary_data_output"})  # KServe's transport options, not sampling fields
ROUTE_HINT = "use /openai/v1/completions for that"


class PromptRequest(SamplingFields):
    """One prompt, one output: an OpenAI completion request's fields that apply on the KServe routes."""
    model_config = ConfigDict(extra="forbid")
    prompt: str | TokenIds
    max_tokens: int | None = 16

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field these routes cannot honour, or None (OpenAIServing.check_common)."""
        if self.stream:
            return "stream", f"stream is not supported on the KServe inference routes; {ROUTE_HINT}"
        if self.n != 1:
            return "n", f"n must be 1 on the KServe inference routes (one output per prompt); {ROUTE_HINT}"
        if self.prompt_logprobs is not None:  # the v1/v2 outputs have no place for them
            return "prompt_logprobs", f"prompt_logprobs are not returned by the KServe inference routes; {ROUTE_HINT}"
        return None


@dataclass(slots=True)
class Prepared:
    """A checked, tokenized prompt with its parameters: ready for ``EngineClient.add_request``."""
    prompt: ProcessedPrompt
    params: SamplingParams
    priority: int
    cache_salt: str | None


@contextmanager
def client_errors(where: str) -> Iterator[None]:
    """Re-raises a client's mistake (a 4xx OpenAIError, a pydantic error) as InvalidInput prefixed with ``where``."""
    try:
        yield
    except ValidationError as e:
        raise InvalidInput(f"{where}: {from_validation_error(e).message}") from e
    except OpenAIError as e:
        if e.status >= 500:
            raise
        raise InvalidInput(f"{where}: {e.message}") from e


def sampling_params(serving: OpenAIServing, req: PromptRequest) -> SamplingParams:
    serving.check_common(req)
    return serving.sampling_params(req, req.max_tokens, None)


def prepare(serving: OpenAIServing, req: PromptRequest, params: SamplingParams, on_worker: bool) -> Prepared:
    return Prepared(serving.process(req.prompt, params, "prompt", on_worker), params, req.priority, req.cache_salt)


def check_prompt_count(serving: OpenAIServing, where: str, count: int) -> None:
    """InvalidInput if a request holds more prompts than the server's ``max_prompts_per_request``."""
    limit = serving.limits.max_prompts_per_request
    if count > limit:
        raise InvalidInput(f"{where} holds {count} prompts; this server takes at most {limit} per request")


# ---- v1 ----------------------------------------------------------------------------------------
def v1_prepare(serving: OpenAIServing, body: object, on_worker: bool = False) -> list[Prepared]:
    """Every instance of a v1 body, checked and tokenized (see ``on_worker`` in the module docstring);
    InvalidInput for the first one that is wrong."""
    if isinstance(body, (bytes, str)):  # KServe passes the raw body on unless Content-Type says JSON (curl -d)
        try:  # the OpenAI routes' parser: lone surrogates and deep nesting are refused too
            body = parse_json(body)  # type: ignore[arg-type]
        except OpenAIError as e:
            raise InvalidInput(e.message) from e
    if not isinstance(body, dict) or "instances" not in body:
        raise InvalidInput('the request body must be a JSON object {"instances": [...]}')
    instances = body["instances"]
    if not isinstance(instances, list) or not instances:
        raise InvalidInput("instances must be a non-empty list")
    check_prompt_count(serving, "instances", len(instances))
    batch = []
    for i, instance in enumerate(instances):
        with client_errors(f"instances[{i}]"):
            if isinstance(instance, str):
                instance = {"prompt": instance}
            if not isinstance(instance, dict):
                raise InvalidInput(f"instances[{i}] must be a prompt string or an object with a 'prompt'")
            req = PromptRequest.model_validate(instance)
            batch.append(prepare(serving, req, sampling_params(serving, req), on_worker))
    return batch


def v1_response(outputs: list[RequestOutput]) -> dict:
    return {"predictions": [{"text": c.text, "finish_reason": c.finish_reason,
                             "usage": _usage(len(out.prompt_token_ids), len(c.token_ids))}
                            for out in outputs for c in out.outputs]}


# ---- v2 ----------------------------------------------------------------------------------------
def v2_prepare(serving: OpenAIServing, request: InferRequest, on_worker: bool = False) -> list[Prepared]:
    """The prompts of ``text_input`` with the request's parameters, checked and tokenized (see ``on_worker``)."""
    texts = v2_texts(request)
    check_prompt_count(serving, TEXT_INPUT, len(texts))
    _check_requested_outputs(request)
    fields = v2_fields(request)
    if "prompt" in fields:
        raise InvalidInput(f"parameters.prompt is not allowed: the prompts are the {TEXT_INPUT} tensor")
    with client_errors("parameters"):  # checked once for the batch, with a stand-in prompt
        shared = PromptRequest.model_validate({**fields, "prompt": ""})
        params = sampling_params(serving, shared)
    batch = []
    for i, text in enumerate(texts):
        with client_errors(f"{TEXT_INPUT}[{i}]"):
            batch.append(prepare(serving, shared.model_copy(update={"prompt": text}), params, on_worker))
    return batch


def v2_response(request: InferRequest, model_name: str, outputs: list[RequestOutput],
                response_id: str) -> InferResponse:
    choices = [c for out in outputs for c in out.outputs]
    usage = {"prompt_tokens": sum(len(out.prompt_token_ids) for out in outputs),
             "completion_tokens": sum(len(c.token_ids) for c in choices)}
    return InferResponse(
        response_id=request.id or response_id, model_name=model_name, parameters=usage,
        infer_outputs=[InferOutput(TEXT_OUTPUT, [len(choices)], "BYTES", data=[c.text for c in choices]),
                       InferOutput(FINISH_REASON, [len(choices)], "BYTES", data=[c.finish_reason for c in choices])],
        use_binary_outputs=request.use_binary_outputs, requested_outputs=request.request_outputs)


def v2_fields(request: InferRequest) -> dict:
    """The request's parameters as plain values (gRPC sends protobuf InferParameters), KServe's own left out."""
    parameters = to_http_parameters(request.parameters or {})
    return {k: v for k, v in parameters.items() if k not in KSERVE_PARAMETERS}


def v2_texts(request: InferRequest) -> list[str]:
    """The prompts: the ``text_input`` tensor's elements (str over REST, bytes over gRPC)."""
    names = [tensor.name for tensor in request.inputs]
    if names != [TEXT_INPUT]:
        raise InvalidInput(f"expected exactly one input, {TEXT_INPUT!r} (BYTES, shape [batch]); got {names}")
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"{TEXT_INPUT} must have datatype BYTES, got {tensor.datatype}")
    data = tensor.data
    if not isinstance(data, list) or not data:
        raise InvalidInput(f"{TEXT_INPUT} must hold at least one prompt")
    shape = list(tensor.shape or [])
    if len(shape) not in (1, 2) or shape[1:] not in ([], [1]) or math.prod(shape) != len(data):
        raise InvalidInput(f"{TEXT_INPUT} must have shape [batch] (or [batch, 1]) matching its {len(data)} "
                           f"elements; got shape {shape}")
    texts = []
    for i, item in enumerate(data):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidInput(f"{TEXT_INPUT}[{i}] is not valid UTF-8: {e}") from e
        if not isinstance(item, str):
            raise InvalidInput(f"{TEXT_INPUT}[{i}] must be a string, got {type(item).__name__}")
        texts.append(item)
    return texts


def _check_requested_outputs(request: InferRequest) -> None:
    known = {t["name"] for t in OUTPUT_TYPES}
    for output in request.request_outputs or []:
        if output.name not in known:
            raise InvalidInput(f"unknown output {output.name!r}; this model has {sorted(known)}")


def _usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
