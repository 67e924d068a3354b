"""POST /v1/chat/completions: messages through the tokenizer's chat template, then one engine request.

Streaming follows OpenAI's chunk sequence: for each choice a first chunk
carrying ``role``, then content chunks (``reasoning_content``, ``content`` and
``tool_calls`` deltas, see ``chat_output.py``), the last of which carries
``finish_reason``; then a usage chunk (``choices: []``) when
``stream_options.include_usage``; then ``data: [DONE]``.

Tools reach the chat template (``apply_chat_template(tools=...)``), and so do
tool-role messages and assistant ``tool_calls`` in the history; which tool choice a
request makes and what a forced one is constrained to is ``tool_calls.py``'s business.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from paged_runtime.engine.client import RequestStream
from paged_runtime.entrypoints.openai.chat_output import ChoiceText
from paged_runtime.entrypoints.openai.constraints import request_constraint, response_format_constraint
from paged_runtime.entrypoints.openai.errors import bad_request
from paged_runtime.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from paged_runtime.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from paged_runtime.entrypoints.openai.serving import (SSE_DONE, OpenAIServing, RequestLimits, StreamingResult, clamp,
                                                     collect_deltas, merge, new_id, now, prompt_logprobs_body,
                                                     render_body, sse, sse_error, top_by_rank, usage)
from paged_runtime.entrypoints.openai.tool_calls import ToolChoice, resolve_tool_choice, tool_constraint
from paged_runtime.entrypoints.openai.tool_parsers import get_tool_parser
from paged_runtime.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from paged_runtime.engine.processor import ProcessedPrompt
from paged_runtime.sampling_params import RequestOutputKind, SamplingParams

# Arguments of apply_chat_template that the request must not override through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template", "tools",
    "documents", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask"})


@dataclass(frozen=True)
class ChatOptions:
    """The chat route's server-wide settings (vLLM's flags of the same names)."""
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses calls out of the model's text
    tool_call_parser: str | None = None  # hermes, llama3_json, mistral (tool_parsers.py)
    reasoning_parser: str | None = None  # deepseek_r1, qwen3 (reasoning_parsers.py)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up, listing the known ones
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)


class ChatServing(OpenAIServing):
    def __init__(self, engine, served_model_names, limits: RequestLimits | None = None,
                 chat_template: str | None = None, options: ChatOptions | None = None, *,
                 prompt_tokens_details: bool = False, adapters=None) -> None:
        super().__init__(engine, served_model_names, limits, chat_template,
                         prompt_tokens_details=prompt_tokens_details, adapters=adapters)
        self.options = options or ChatOptions()
        self.reasoning_parser = (get_reasoning_parser(self.options.reasoning_parser)
                                 if self.options.reasoning_parser else None)
        # A constraint starts once the reasoning has ended: after the end marker's tokens.
        self.reasoning_end_ids = (self.reasoning_parser.end_token_ids(self.tokenizer_worker.tokenizer)
                                  if self.reasoning_parser else None)

    async def create(self, req: ChatCompletionRequest) -> dict | StreamingResult:
        """The response body, or a StreamingResult for ``stream``. Raises before anything runs if the request is bad."""
        model, tool_choice, params, processed = await self._prepare(req)
        request_id = new_id("chatcmpl")
        streams = self.submit(request_id, [processed], params, req)
        if req.stream:
            return StreamingResult(self._stream(req, tool_choice, request_id, model, streams[0]), streams)
        return self._response(req, tool_choice, request_id, model, (await collect_deltas(streams))[0])

    async def render_request(self, req: ChatCompletionRequest) -> dict:
        """What ``create`` would submit, as vLLM's ``GenerateRequest`` body, without generating."""
        model, _, params, processed = await self._prepare(req)
        return render_body(new_id("chatcmpl"), processed, params, req, model)

    async def _prepare(self, req: ChatCompletionRequest) -> tuple[str, ToolChoice, SamplingParams, ProcessedPrompt]:
        """(the model name to echo, the tool choice, the sampling parameters, the rendered prompt, checked)."""
        model = self.resolve_model(req.model)
        self.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tool_choice = resolve_tool_choice(req, self.options.enable_auto_tool_choice)
        constraint, source = self._constraint(req, tool_choice)
        fields = {"logprobs": "top_logprobs", "structured_outputs": source,
                  "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
        params = self.sampling_params(req, max_tokens, logprobs, fields=fields, structured_outputs=constraint)
        # Each step's delta, never a copy of the sequence; whole responses put the deltas together
        # (not FINAL_ONLY: the step loop takes its time-to-first-token and inter-token metrics from each output).
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        if tool_choice.mode == "auto":  # some formats' markers ([TOOL_CALLS], <|python_tag|>) are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        text, token_ids = await self.tokenizer_worker.run(self.render, req.messages, req.add_generation_prompt,
                                                          req.continue_final_message, template_kwargs(req),
                                                          template_tools(req))
        processed = await self.process_off_loop({"prompt": text, "prompt_token_ids": token_ids}, params, "messages",
                                                 source)
        return model, tool_choice, params, processed

    def _constraint(self, req: ChatCompletionRequest, tool_choice: ToolChoice):
        """(the output constraint, the field it came from): response_format, a forced tool choice, or the
        vLLM fields; after the reasoning when a reasoning parser is on."""
        extra = []
        if (response_format := response_format_constraint(req.response_format)) is not None:
            extra.append(("response_format", response_format))
        if (forced := tool_constraint(req, tool_choice)) is not None:
            extra.append(("tool_choice", forced))
        constraint, source = request_constraint(req, extra)
        if constraint is not None and self.reasoning_end_ids:
            constraint = dataclasses.replace(constraint, after_token_ids=list(self.reasoning_end_ids))
        return constraint, source

    def _choice_text(self, req: ChatCompletionRequest, tool_choice: ToolChoice) -> ChoiceText:
        tool_parser = (get_tool_parser(self.options.tool_call_parser, self.tokenizer_worker.tokenizer)
                       if tool_choice.mode == "auto" else None)
        return ChoiceText(tool_choice, tool_parser, self.reasoning_parser, req.include_reasoning)

    # ---- the prompt ------------------------------------------------------------------------
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
               template_kwargs: dict | None, tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The chat template applied to ``messages``: (text, token ids). Raises a 400 naming what is wrong.
        Uses the worker's tokenizer: call it on the worker (``self.tokenizer_worker.run``)."""
        text = render_chat(self.tokenizer_worker.tokenizer, self.chat_template, messages, add_generation_prompt,
                           continue_final_message, template_kwargs, tools)
        return text, self.tokenizer_worker.encode(text, "messages", add_special_tokens=False)

    # ---- whole response ----------------------------------------------------------------------
    def _response(self, req: ChatCompletionRequest, tool_choice: ToolChoice, request_id: str, model: str,
                  out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            parsed = self._choice_text(req, tool_choice)
            message = {"role": "assistant", **parsed.whole(c.text), "refusal": None}
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(req, c.token_ids, c.logprobs),
                            "finish_reason": _finish_reason(c.finish_reason, tool_choice, parsed),
                            "stop_reason": c.stop_reason})
        num_completion = sum(len(c.token_ids) for c in out.outputs)
        body = {"id": request_id, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
                "usage": usage([out], num_completion, self.prompt_tokens_details)}
        if req.prompt_logprobs is not None:  # vLLM's place for them: the response, not a choice
            body["prompt_logprobs"] = prompt_logprobs_body(out, req.prompt_logprobs)
        return body

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int],
                  entries: list[PositionLogprobs] | None) -> dict | None:
        if not req.logprobs:
            return None
        top_n = req.top_logprobs or 0
        content = [_token_logprob(entry[token_id], top_by_rank(entry, top_n))
                   for token_id, entry in zip(token_ids, entries or [])]
        return {"content": content, "refusal": None}

    # ---- streaming -----------------------------------------------------------------------
    async def _stream(self, req: ChatCompletionRequest, tool_choice: ToolChoice, request_id: str, model: str,
                      stream: RequestStream) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        if include_usage:
            head["usage"] = None  # OpenAI: every chunk has usage, null until the last one

        def chunk(choices: list[dict]) -> str:
            return sse({**head, "choices": choices})

        finished: set[int] = set()
        texts = [self._choice_text(req, tool_choice) for _ in range(req.n)]
        num_completion = 0  # outputs are deltas: the usage chunk's count is their sum
        try:
            for index in range(req.n):
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for _, out in merge([stream]):
                num_completion += sum(len(c.delta_token_ids) for c in out.outputs)
                choices = [choice for c in out.outputs
                           if (choice := self._delta_choice(req, tool_choice, texts[c.index], finished, c)) is not None]
                if choices:
                    yield chunk(choices)
                if out.finished and include_usage:
                    yield sse({**head, "choices": [], "usage": usage([out], num_completion,
                                                                     self.prompt_tokens_details)})
        except Exception as e:  # the engine failed mid-stream: tell the client in-band
            yield sse_error(e)
        finally:
            stream.abort()
        yield SSE_DONE

    def _delta_choice(self, req: ChatCompletionRequest, tool_choice: ToolChoice, text: ChoiceText,
                      finished: set[int], c: CompletionOutput) -> dict | None:
        if c.index in finished:
            return None
        delta = text.feed(c.delta_text) if c.delta_text else {}
        if c.finish_reason is not None:
            finished.add(c.index)
            delta = _merged(delta, text.finish())
        has_logprobs = bool(req.logprobs and c.delta_token_ids)
        if not delta and c.finish_reason is None and not has_logprobs:
            return None
        if not delta and c.finish_reason is None:
            delta = {"content": ""}  # logprobs of tokens whose text the parsers still hold
        return {"index": c.index, "delta": delta,
                "logprobs": self._logprobs(req, c.delta_token_ids, c.delta_logprobs),
                "finish_reason": _finish_reason(c.finish_reason, tool_choice, text), "stop_reason": c.stop_reason}


def _finish_reason(reason: str | None, tool_choice: ToolChoice, text: ChoiceText) -> str | None:
    """"tool_calls" when an auto or required choice ended (not cut short) having called tools."""
    if reason == "stop" and text.tools_called and tool_choice.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def _merged(first: dict, second: dict) -> dict:
    """Two delta messages as one: text fields concatenated, tool call lists joined."""
    out = dict(first)
    for key, value in second.items():
        out[key] = out.get(key, [] if key == "tool_calls" else "") + value
    return out


def render_chat(tokenizer, chat_template: str | None, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict | None, tools: list[dict] | None = None) -> str:
    """The chat template (``chat_template``, else the tokenizer's) applied to ``messages``, as text. Raises a 400
    naming what is wrong. The one way a chat becomes a prompt: the chat route, /tokenize, and the Ray ingress
    that renders prompts for its router all call it."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", param="messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request("continue_final_message needs add_generation_prompt set to false",
                          param="continue_final_message")
    conversation = [_template_message(i, m) for i, m in enumerate(messages)]
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's",
                          param="continue_final_message")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # the template's own checks (roles must alternate, ...) are the client's business
        raise bad_request(f"the chat template could not render these messages: {e}", param="messages") from e


def template_kwargs(req: ChatCompletionRequest) -> dict:
    """The request's ``chat_template_kwargs``, with OpenAI's ``reasoning_effort`` for templates that read it."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's shape), or None."""
    return [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None


def _template_message(i: int, m: ChatMessage) -> dict:
    """A request message as the chat template wants it: role, plain-text content, and for tool use the
    assistant's ``tool_calls`` (arguments as objects, as templates iterate them) or the tool's ``tool_call_id``."""
    if m.role == "function":
        raise bad_request("function messages are deprecated and not supported: use tool messages",
                          param=f"messages[{i}].role")
    role = "system" if m.role == "developer" else m.role  # templates know no developer role
    message = {"role": role}
    if m.tool_calls:
        if role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
        message["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(m.tool_calls)]
    if role == "tool":
        if m.tool_call_id is None:
            raise bad_request("a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        message["name"] = m.name
    if m.content is None:
        if role != "assistant":
            raise bad_request(f"a {m.role} message needs content", param=f"messages[{i}].content")
        return {**message, "content": ""}
    if isinstance(m.content, str):
        return {**message, "content": m.content}
    texts = []
    for j, part in enumerate(m.content):
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and role == "assistant" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise bad_request(f"content part type {part.type!r} is not supported: this model reads text only "
                              "(parts must be {'type': 'text', 'text': ...})", param=f"messages[{i}].content[{j}]")
    return {**message, "content": "\n".join(texts)}


def _template_call(i: int, j: int, call: dict) -> dict:
    """An assistant's tool call for the template: OpenAI's shape, its arguments parsed into an object."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("a tool call is {'id', 'type': 'function', 'function': {'name', 'arguments'}}",
                          param=f"messages[{i}].tool_calls[{j}]")
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise bad_request("tool call arguments must be JSON text", param=f"messages[{i}].tool_calls[{j}]") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _token_logprob(chosen: Logprob, top: list[Logprob]) -> dict:
    return {**_token_entry(chosen), "top_logprobs": [_token_entry(lp) for lp in top]}


def _token_entry(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": clamp(lp.logprob), "bytes": list(token.encode("utf-8"))}
