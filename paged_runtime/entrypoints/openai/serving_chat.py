"""POST /v1/chat/completions: messages through the tokenizer's chat template, then one engine request.

Streaming follows OpenAI's chunk sequence: for each choice a first chunk
carrying ``role``, then content chunks, the last of which carries
``finish_reason``; then a usage chunk (``choices: []``) when
``stream_options.include_usage``; then ``data: [DONE]``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from paged_runtime.engine.client import RequestStream
from paged_runtime.entrypoints.openai.errors import bad_request
from paged_runtime.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from paged_runtime.entrypoints.openai.serving import (SSE_DONE, OpenAIServing, StreamingResult, clamp, collect_deltas,
                                                     merge, new_id, now, prompt_logprobs_body, sse, sse_error,
                                                     top_by_rank, usage)
from paged_runtime.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from paged_runtime.sampling_params import RequestOutputKind

# Arguments of apply_chat_template that the request must not override through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template", "tools",
    "documents", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask"})


class ChatServing(OpenAIServing):
    async def create(self, req: ChatCompletionRequest) -> dict | StreamingResult:
        """The response body, or a StreamingResult for ``stream``. Raises before anything runs if the request is bad."""
        model = self.resolve_model(req.model)
        self.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        fields = {"logprobs": "top_logprobs",
                  "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
        params = self.sampling_params(req, max_tokens, logprobs, fields=fields)
        # Each step's delta, never a copy of the sequence; whole responses put the deltas together
        # (not FINAL_ONLY: the step loop takes its time-to-first-token and inter-token metrics from each output).
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        text, token_ids = await self.tokenizer_worker.run(self.render, req.messages, req.add_generation_prompt,
                                                          req.continue_final_message, req.chat_template_kwargs)
        processed = await self.process_off_loop({"prompt": text, "prompt_token_ids": token_ids}, params, "messages")
        request_id = new_id("chatcmpl")
        streams = self.submit(request_id, [processed], params, req)
        if req.stream:
            return StreamingResult(self._stream(req, request_id, model, streams[0]), streams)
        return self._response(req, request_id, model, (await collect_deltas(streams))[0])

    # ---- the prompt ------------------------------------------------------------------------
    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
               template_kwargs: dict | None) -> tuple[str, list[int]]:
        """The chat template applied to ``messages``: (text, token ids). Raises a 400 naming what is wrong.
        Uses the worker's tokenizer: call it on the worker (``self.tokenizer_worker.run``)."""
        tokenizer = self.tokenizer_worker.tokenizer
        if not (self.chat_template or getattr(tokenizer, "chat_template", None)):
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
            text = tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **kwargs)
        except Exception as e:  # the template's own checks (roles must alternate, ...) are the client's business
            raise bad_request(f"the chat template could not render these messages: {e}", param="messages") from e
        return text, self.tokenizer_worker.encode(text, "messages", add_special_tokens=False)

    # ---- whole response ----------------------------------------------------------------------
    def _response(self, req: ChatCompletionRequest, request_id: str, model: str, out: RequestOutput) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": self._logprobs(req, c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        num_completion = sum(len(c.token_ids) for c in out.outputs)
        body = {"id": request_id, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
                "usage": usage(len(out.prompt_token_ids), num_completion, out.num_cached_tokens)}
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
    async def _stream(self, req: ChatCompletionRequest, request_id: str, model: str,
                      stream: RequestStream) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        if include_usage:
            head["usage"] = None  # OpenAI: every chunk has usage, null until the last one

        def chunk(choices: list[dict]) -> str:
            return sse({**head, "choices": choices})

        finished: set[int] = set()
        num_completion = 0  # outputs are deltas: the usage chunk's count is their sum
        try:
            for index in range(req.n):
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for _, out in merge([stream]):
                num_completion += sum(len(c.delta_token_ids) for c in out.outputs)
                choices = [choice for c in out.outputs if (choice := self._delta_choice(req, finished, c)) is not None]
                if choices:
                    yield chunk(choices)
                if out.finished and include_usage:
                    yield sse({**head, "choices": [], "usage": usage(len(out.prompt_token_ids), num_completion,
                                                                     out.num_cached_tokens)})
        except Exception as e:  # the engine failed mid-stream: tell the client in-band
            yield sse_error(e)
        finally:
            stream.abort()
        yield SSE_DONE

    def _delta_choice(self, req: ChatCompletionRequest, finished: set[int], c: CompletionOutput) -> dict | None:
        if c.index in finished:
            return None
        has_logprobs = bool(req.logprobs and c.delta_token_ids)
        if not c.delta_text and c.finish_reason is None and not has_logprobs:
            return None
        if c.finish_reason is not None:
            finished.add(c.index)
        delta = {"content": c.delta_text} if c.delta_text or c.finish_reason is None else {}
        return {"index": c.index, "delta": delta,
                "logprobs": self._logprobs(req, c.delta_token_ids, c.delta_logprobs),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def _template_message(i: int, m: ChatMessage) -> dict:
    """A request message as the chat template wants it: role and plain-text content."""
    if m.role in ("tool", "function") or m.tool_calls or m.tool_call_id:
        raise bad_request("tool and function messages are not supported yet: this runtime has no tool calling",
                          param=f"messages[{i}].role")
    role = "system" if m.role == "developer" else m.role  # templates know no developer role
    if m.content is None:
        if role != "assistant":
            raise bad_request(f"a {m.role} message needs content", param=f"messages[{i}].content")
        return {"role": role, "content": ""}
    if isinstance(m.content, str):
        return {"role": role, "content": m.content}
    texts = []
    for j, part in enumerate(m.content):
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and role == "assistant" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise bad_request(f"content part type {part.type!r} is not supported: this model reads text only "
                              "(parts must be {'type': 'text', 'text': ...})", param=f"messages[{i}].content[{j}]")
    return {"role": role, "content": "\n".join(texts)}


def _token_logprob(chosen: Logprob, top: list[Logprob]) -> dict:
    return {**_token_entry(chosen), "top_logprobs": [_token_entry(lp) for lp in top]}


def _token_entry(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": clamp(lp.logprob), "bytes": list(token.encode("utf-8"))}
