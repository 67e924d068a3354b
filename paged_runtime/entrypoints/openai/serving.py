"""What the completion and chat routes share: model names, parameters, prompt checks, submission, SSE framing.

Everything that can be wrong with a request is found before the first
request reaches the engine, so a 4xx never leaves half a request running.
The routes check only what is theirs (unsupported fields, route-specific
combinations, the context length as OpenAI words it); ``SamplingParams`` and
``EngineClient.process`` check the rest, and their ``ParameterError`` names
the field.

Tokenizing and chat-template rendering run off the event loop, on each
serving object's ``TokenizerWorker``, so a multi-megabyte prompt never stops
the server from answering (``/health`` included) while it is tokenized.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

from paged_runtime.engine.client import EngineClient, RequestStream
from paged_runtime.engine.processor import (ProcessedPrompt, PromptType, check_logprobs, check_prompt_chars,
                                            max_prompt_chars)
from paged_runtime.config import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES
from paged_runtime.entrypoints.openai.errors import bad_request, from_exception, from_parameter_error, model_not_found
from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_runtime.entrypoints.openai.protocol import SamplingFields
from paged_runtime.lora.request import LoRARequest
from paged_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from paged_runtime.pooling_params import PoolingParams
from paged_runtime.sampling_params import ParameterError, SamplingParams, StructuredOutputsParams

MIN_LOGPROB = -9999.0  # OpenAI's stand-in for "very unlikely"; JSON has no -inf
T = TypeVar("T")


@dataclass(frozen=True)
class RequestLimits:
    """What one HTTP request may ask for; beyond it, a 4xx before any work (``n`` is capped by max_num_seqs)."""
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # ServerConfig's defaults
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_prompts_per_request < 1:
            raise ValueError("request limits must be positive")


class TokenizerWorker:
    """A private copy of the tokenizer and the one thread that ever uses it.

    A Hugging Face fast tokenizer raises "Already borrowed" when two threads use it at once; owning
    both the copy and the only thread that touches it rules that out, and keeps long tokenizations
    off the event loop (the Rust tokenizer releases the GIL while it works).
    """

    def __init__(self, tokenizer: object, max_model_len: int) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.max_model_len = max_model_len
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the worker thread; ``fn`` may use ``self.tokenizer``."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @cached_property
    def max_chars(self) -> int:
        return max_prompt_chars(self.tokenizer, self.max_model_len)

    def encode(self, text: str, param: str = "prompt", **kwargs) -> list[int]:
        """``text``'s token ids (on the worker thread); a text longer than any prompt that fits the context is a
        400 at once, untokenized, so one huge prompt cannot hold this thread (and everyone's requests) for long."""
        try:
            check_prompt_chars(text, self.max_chars)
        except ParameterError as e:
            raise bad_request(str(e), param=param, code="context_length_exceeded") from e
        return self.tokenizer.encode(text, **kwargs)


class OpenAIServing:
    """Holds the engine and the served model names; subclasses implement one route each."""

    def __init__(self, engine: EngineClient, served_model_names: Sequence[str],
                 limits: RequestLimits | None = None, chat_template: str | None = None, *,
                 prompt_tokens_details: bool = False, adapters: LoRAAdapters | None = None) -> None:
        """``chat_template``: a Jinja template that replaces the tokenizer's (``--chat-template``);
        ``prompt_tokens_details``: usage reports ``cached_tokens`` (``--enable-prompt-tokens-details``);
        ``adapters``: the server's LoRA adapters, served as models of their own over this one."""
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.engine = engine
        self.prompt_tokens_details = prompt_tokens_details
        self.served_model_names = list(served_model_names)
        self.limits = limits or RequestLimits()
        self.chat_template = chat_template
        self.tokenizer_worker = TokenizerWorker(engine.tokenizer, engine.max_model_len)
        self.adapters = adapters

    # ---- request checks -----------------------------------------------------------------
    def resolve_model(self, requested: str | None) -> str:
        """The name to echo back: the requested one if served, the first served name when absent."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names and self.adapter(requested) is None:
            raise model_not_found(requested)
        return requested

    def adapter(self, requested: str | None) -> LoRARequest | None:
        """The LoRA adapter over this model that ``requested`` names, if any."""
        if self.adapters is None or not requested or requested in self.served_model_names:
            return None
        adapter = self.adapters.lookup(requested)
        return adapter if adapter is not None and adapter.base_model_name in self.served_model_names else None

    def check_common(self, req: SamplingFields) -> None:
        unsupported = req.unsupported() or req.refused_extra()
        if unsupported is not None:
            raise bad_request(unsupported[1], param=unsupported[0], code="unsupported_parameter")
        req.log_unknown_fields()
        if req.prompt_logprobs is not None and req.stream:  # as vLLM: streamed chunks have no place for them
            raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            raise bad_request("continuous_usage_stats is not supported: usage comes in one chunk at the end "
                              "(include_usage)", param="stream_options.continuous_usage_stats",
                              code="unsupported_parameter")
        if req.priority != 0 and self.engine.config.scheduling_policy != "priority":
            raise bad_request("priority is only honoured with --scheduling-policy priority; this server uses "
                              f"{self.engine.config.scheduling_policy!r}", param="priority")

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None, *,
                        best_of: int | None = None, prompt_logprobs: int | None = None,
                        fields: dict[str, str] | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams from the request; a value SamplingParams rejects is a 400 naming its field.

        A field the request leaves unset takes the engine's ``default_sampling`` (the model's
        generation_config.json), then SamplingParams' own default; a default ``max_tokens`` also caps what
        the request asks for (vLLM's ``get_max_tokens``). ``prompt_logprobs``: what the route needs (echo),
        beside the request's own ``prompt_logprobs`` (the engine computes the larger).

        ``fields``: the request's name for a SamplingParams field where the route spells it differently
        (chat's ``top_logprobs`` is ``logprobs``), so the error names what the client sent.
        """
        defaults = self.engine.default_sampling
        default = lambda name, fallback: _default(getattr(req, name), defaults.get(name, fallback))
        asked = [k for k in (prompt_logprobs, req.prompt_logprobs) if k is not None]
        try:
            params = SamplingParams(
                n=req.n, best_of=best_of, temperature=default("temperature", 1.0), top_p=default("top_p", 1.0),
                top_k=default("top_k", 0), min_p=default("min_p", 0.0),
                presence_penalty=_default(req.presence_penalty, 0.0),
                frequency_penalty=_default(req.frequency_penalty, 0.0),
                repetition_penalty=default("repetition_penalty", 1.0),
                logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
                seed=req.seed, max_tokens=_capped(max_tokens, defaults.get("max_tokens")), min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=max(asked) if asked else None, skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None,
                truncate_prompt_tokens=req.truncate_prompt_tokens, structured_outputs=structured_outputs)
            check_logprobs(params, self.engine.config.max_logprobs)
            return params
        except ParameterError as e:
            raise from_parameter_error(e, (fields or {}).get(e.param)) from e

    async def process_off_loop(self, prompt: PromptType, params: SamplingParams, prompt_param: str,
                               constraint_param: str | None = None) -> ProcessedPrompt:
        """``process`` on the tokenizer worker, with the worker's tokenizer: what the routes use."""
        return await self.tokenizer_worker.run(self.process, prompt, params, prompt_param, True, constraint_param)

    def process(self, prompt: PromptType, params: SamplingParams, prompt_param: str,
                on_worker: bool = False, constraint_param: str | None = None) -> ProcessedPrompt:
        """Tokenize and validate one prompt on the calling thread (the output constraint is compiled here);
        prompt + max_tokens beyond the context is a 400 naming both. ``on_worker``: called on the tokenizer
        worker, which tokenizes a text prompt (the engine's ``process`` then only checks token ids).
        ``constraint_param``: the request field the constraint came from, named by a compile error."""
        if isinstance(prompt, str) and on_worker:
            prompt = {"prompt": prompt, "prompt_token_ids": self.tokenizer_worker.encode(prompt, prompt_param)}
        try:
            processed = self.engine.process(prompt, params)
        except ParameterError as e:
            renamed = {"prompt": prompt_param, "structured_outputs": constraint_param}.get(e.param)
            raise from_parameter_error(e, renamed) from e
        num_prompt, limit = len(processed.token_ids), self.engine.max_model_len
        if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
            where = "messages" if prompt_param == "messages" else "prompt"
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the {where}, {params.max_tokens} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                param="max_tokens", code="context_length_exceeded")
        return processed

    # ---- running -------------------------------------------------------------------------
    def prompt_list(self, value: str | list, param: str) -> list[str | list[int]]:
        """A completions ``prompt`` or embeddings ``input`` as its prompts (a token-id list is one prompt); a 400
        naming ``param`` when it is empty or holds more than ``max_prompts_per_request``."""
        if isinstance(value, list) and not value:
            raise bad_request(f"{param} must not be empty", param=param)
        prompts = [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)
        if len(prompts) > self.limits.max_prompts_per_request:
            raise bad_request(f"{param} holds {len(prompts)} prompts; this server takes at most "
                              f"{self.limits.max_prompts_per_request} per request", param=param)
        return prompts

    def submit(self, base_id: str, prompts: list[ProcessedPrompt], params: SamplingParams,
               req: SamplingFields, pooling: PoolingParams | None = None) -> list[RequestStream]:
        """Queue every prompt (with ``req``'s priority and cache salt), or none: if one is refused (engine full),
        the others are aborted. ``pooling``: they are pooling requests (embeddings)."""
        streams: list[RequestStream] = []
        lora_request = self.adapter(req.model)
        self.resolve_model(req.model)  # a 404 for an adapter unloaded since the request was resolved
        try:
            for i, prompt in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(self.engine.add_request(request_id, prompt, params, req.priority, req.cache_salt,
                                                       pooling=pooling, lora_request=lora_request))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams


@dataclass
class StreamingResult:
    """An SSE body, and the requests behind it: abort them if the body is never (fully) sent."""
    body: AsyncIterator[str]
    streams: list[RequestStream]

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _default(value, default):
    return default if value is None else value


def _capped(max_tokens: int | None, cap: int | None) -> int | None:
    """The request's max_tokens under the model's recommended cap (either may be None: no limit)."""
    return max_tokens if cap is None else cap if max_tokens is None else min(max_tokens, cap)


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream, in order."""
    final: list[RequestOutput | None] = [None] * len(streams)
    async for i, output in merge(streams):
        if output.finished:
            final[i] = output
    return final  # type: ignore[return-value]


async def collect_deltas(streams: list[RequestStream]) -> list[RequestOutput]:
    """The whole finished output of every stream, in order, put together from its DELTA outputs (a
    FINAL_ONLY output is its own whole). Reads the ``delta_*`` fields: an abort's output repeats none."""
    texts: list[dict[int, list[str]]] = [{} for _ in streams]
    wholes: list[dict[int, CompletionOutput]] = [{} for _ in streams]
    final: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        for c in out.outputs:
            whole = wholes[i].get(c.index)
            if whole is None:
                whole = wholes[i][c.index] = CompletionOutput(c.index, "", [], None,
                                                              [] if c.logprobs is not None else None)
            texts[i].setdefault(c.index, []).append(c.delta_text)
            whole.token_ids += c.delta_token_ids
            if whole.logprobs is not None:
                whole.logprobs += c.delta_logprobs
            whole.cumulative_logprob, whole.finish_reason, whole.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                                c.stop_reason)
        if out.finished:
            for index, whole in wholes[i].items():
                whole.text = "".join(texts[i][index])
            final[i] = dataclasses.replace(out, outputs=[wholes[i][index] for index in sorted(wholes[i])])
    return final  # type: ignore[return-value]


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams as they arrive. Leaving early aborts every stream."""
    try:
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
            return
        async for item in _merged(streams):
            yield item
    finally:
        for stream in streams:
            stream.abort()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


# ---- response pieces ---------------------------------------------------------------------
def usage(outputs: Sequence[RequestOutput], num_completion_tokens: int, prompt_tokens_details: bool) -> dict:
    """OpenAI's usage of ``outputs`` (one per prompt); ``cached_tokens`` only with ``prompt_tokens_details``
    (``--enable-prompt-tokens-details``): it tells a caller which prompts reached the cache before its own."""
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    body = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
    if prompt_tokens_details:
        body["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}
    return body


def render_body(request_id: str, prompt: ProcessedPrompt, params: SamplingParams, req: SamplingFields,
                model: str) -> dict:
    """vLLM's ``GenerateRequest`` for one prompt, as its render routes return it: the exact prompt token ids
    and sampling parameters the generate route would submit (``features``: text models have none)."""
    return {"request_id": request_id, "token_ids": list(prompt.token_ids), "features": None,
            "sampling_params": sampling_params_body(dataclasses.replace(params, max_tokens=prompt.max_tokens)),
            "model": model, "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
            "cache_salt": req.cache_salt, "priority": req.priority}


def sampling_params_body(params: SamplingParams) -> dict:
    """``params`` as JSON: every public field (enums by value, a constraint as its fields)."""
    body = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.repr}
    body["output_kind"] = params.output_kind.value
    if params.structured_outputs is not None:
        body["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return body


def clamp(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def top_by_rank(entry: dict[int, Logprob], top_n: int) -> list[Logprob]:
    """The ``top_n`` most likely tokens of a position (the sampled one only if it is among them)."""
    ranked = [lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n]
    return sorted(ranked, key=lambda lp: lp.rank)[:top_n]


def prompt_logprobs_body(out: RequestOutput, top_n: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt position (the first is null: nothing precedes it) a dict of token id
    (a string in JSON) -> {logprob, rank, decoded_token}: the prompt's own token and the ``top_n`` most likely."""
    body: list[dict | None] = [None]
    for token_id, entry in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [])[1:]):
        kept = {t: lp for t, lp in (entry or {}).items() if t == token_id or (lp.rank is not None and lp.rank <= top_n)}
        body.append({str(t): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                     for t, lp in kept.items()})
    return body


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    """An error after the stream has started: the status is already 200, so it travels as a data frame."""
    return sse(from_exception(e).body())
