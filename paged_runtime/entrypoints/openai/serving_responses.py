"""POST /v1/responses (OpenAI's Responses API) on the chat route's machinery, and its stored responses.

A Responses request becomes a chat request (``chat_request``): the messages are ``instructions`` (a system
message), the stored conversation of ``previous_response_id``, then ``input`` (``conversation``); ``text.format``
is chat's ``response_format``, the flat function ``tools`` and ``tool_choice`` are chat's, ``max_output_tokens``
is ``max_completion_tokens``, ``reasoning.effort`` is ``reasoning_effort``. ``ChatServing._prepare`` then checks,
renders and constrains it exactly as for chat, so both routes give the same tokens for the same conversation; an
error it raises is renamed to the Responses field (``messages[2]`` -> ``input[1]``, ...).

The output goes through chat's ``ChoiceText`` (reasoning / content / tool calls) delta by delta into
``OutputItems``: ``reasoning``, ``message`` (one ``output_text`` part) and ``function_call`` items in the order the
text wrote them, and the stream events that build them, in OpenAI's order::

    response.created, response.in_progress,
    per item: response.output_item.added,
        message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                   response.content_part.done
        reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                   response.content_part.done
        function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
      response.output_item.done,
    response.completed (or response.incomplete, response.failed)

every event with its ``sequence_number``. A whole response is built by the same calls, so a stream's events put
together equal the response it ends with. ``status`` is "completed", or "incomplete" with
``incomplete_details.reason`` "max_output_tokens" when the output was cut at the token limit.

``store`` (default true) keeps the finished response and its conversation in the router's ``ResponseStore``
under the caller's owner (``Tenant.owner``); ``background`` runs it as a task (GET polls it, cancel aborts it).
"""
from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from paged_runtime.entrypoints.openai.errors import OpenAIError, bad_request, from_exception
from paged_runtime.entrypoints.openai.protocol import (ChatCompletionRequest, ResponsesRequest, ResponseTextFormat,
                                                       SamplingFields)
from paged_runtime.entrypoints.openai.response_store import ResponseStore, StoredResponse
from paged_runtime.entrypoints.openai.serving import StreamingResult, merge, now, usage
from paged_runtime.entrypoints.openai.serving_chat import ChatServing
from paged_runtime.outputs import RequestOutput

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")
FINISHED = ("completed", "incomplete")  # a response whose conversation can be continued
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
MAX_LIST_LIMIT = 100  # OpenAI's bound on a list's page


def new_response_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request, as the chat route's ----------------------------------------------------------------------
def conversation(items: list[Any], where: str = "input") -> tuple[list[dict], list[str]]:
    """Input (or output) items as chat messages, and for each message the item it came from (errors name it).
    Consecutive function calls join the assistant message before them; reasoning items are not replayed."""
    messages: list[dict] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad_request("an input item is an object (a message, function_call or function_call_output)",
                              param=at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"a message's role is user, assistant, system or developer, not {role!r}",
                                  param=f"{at}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", at), "type": "function",
                    "function": {"name": _string(item, "name", at), "arguments": _string(item, "arguments", at)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", at),
                             "content": output if isinstance(output, str) else _text(output, f"{at}.output")})
        elif kind == "reasoning":
            continue  # chat templates drop earlier turns' reasoning
        else:
            raise bad_request(f"input item type {kind!r} is not supported; supported: {', '.join(INPUT_ITEM_TYPES)}",
                              param=f"{at}.type")
        origins.append(at)
    return messages, origins


def listed_input(req: ResponsesRequest) -> list[dict]:
    """The request's input as GET /v1/responses/{id}/input_items lists it: each item with an id of its kind and a
    message's text as content parts (input_text; an assistant's, output_text)."""
    items = [] if req.input is None else req.input if isinstance(req.input, list) else [req.input]
    return [_listed(item if isinstance(item, dict) else {"role": "user", "content": item}) for item in items]


def _listed(item: dict) -> dict:
    kind = item.get("type", "message")
    listed = {"id": new_response_id(ITEM_ID_PREFIXES.get(kind, "item")), "type": kind, **item}
    if kind == "message":
        listed.setdefault("status", "completed")
        if isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": item["content"]}]
    return listed


def _string(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"a {item.get('type')} item needs {key} (a string)", param=f"{at}.{key}")
    return value


def _text(content: Any, at: str) -> str:
    """A message's content as text: a string, or its text parts joined by newlines (as chat's are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content is a string or a list of content parts", param=at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(text, str):
            raise bad_request(f"content part type {kind!r} is not supported: this model reads text only (parts are "
                              "{'type': 'input_text', 'text': ...})", param=f"{at}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request with the same prompt, sampling, constraint and tools."""
    sampling = {name: getattr(req, name) for name in SamplingFields.model_fields}
    return ChatCompletionRequest.model_validate({
        **sampling, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "response_format": _response_format(req.text.format if req.text else None),
        "tools": [_chat_tool(i, tool) for i, tool in enumerate(req.tools)] if req.tools else None,
        "tool_choice": _chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        "chat_template_kwargs": req.chat_template_kwargs})


def _response_format(fmt: ResponseTextFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("a text.format of type json_schema needs its schema", param="text.format.schema")
    if not fmt.name:
        raise bad_request("a text.format of type json_schema needs a name", param="text.format.name")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "description": fmt.description,
                                                   "schema": fmt.json_schema, "strict": fmt.strict}}


def _chat_tool(i: int, tool) -> dict:
    if tool.type != "function":
        raise bad_request(f"tool type {tool.type!r} is not supported: this server runs no built-in tools (only "
                          "'function' tools, which the client runs)", param=f"tools[{i}].type")
    if not tool.name:
        raise bad_request("a function tool needs a name", param=f"tools[{i}].name")
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters, "strict": tool.strict}}


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(f"tool_choice {choice.get('type')!r} is not supported: use 'none', 'auto', 'required' or "
                          "{'type': 'function', 'name': ...}", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


_CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "reasoning_effort": "reasoning.effort", "logprobs": "top_logprobs"}


def renamed(error: OpenAIError, origins: list[str]) -> OpenAIError:
    """A chat-route error with its ``param`` as the Responses request spells it."""
    param = error.param
    if param is None:
        return error
    if match := re.fullmatch(r"messages\[(\d+)\].*", param):
        index = int(match.group(1))
        param = origins[index] if index < len(origins) else "input"
    elif match := re.fullmatch(r"tools\[(\d+)\]\.function(.*)", param):
        param = f"tools[{match.group(1)}]{match.group(2)}"
    else:
        head, dot, rest = param.partition(".")
        param = _CHAT_PARAMS.get(head, head) + (dot + rest if head != "response_format" else "")
    return OpenAIError(error.status, error.message, error.type, param, error.code, error.headers)


# ---- the output ---------------------------------------------------------------------------------------------
class OutputItems:
    """A response's output items, built from one choice's parsed deltas (``ChoiceText.feed``/``finish``), and
    the stream events (without sequence numbers) that build them. ``add`` per delta, ``finish`` once."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written: the last of items
        self._text = ""  # its text, or its arguments, so far
        self._call_index: int | None = None

    def add(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if delta.get("reasoning_content"):
            events += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._write("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, status: str) -> list[dict]:
        """Closes the open item with ``status`` ("completed", or "incomplete": the output was cut short); an
        output with no item gets an empty message."""
        events = [] if self.items else self._start({"type": "message"})
        return events + self._close(status)

    def _write(self, kind: str, text: str) -> list[dict]:
        events = [] if self._open is not None and self._open["type"] == kind else self._close() + self._start(
            {"type": kind})
        self._text += text
        item = self._position()
        if kind == "message":
            return events + [{"type": "response.output_text.delta", **item, "content_index": 0, "delta": text,
                              "logprobs": []}]
        return events + [{"type": "response.reasoning_text.delta", **item, "content_index": 0, "delta": text}]

    def _call(self, call: dict) -> list[dict]:
        events: list[dict] = []
        function = call.get("function") or {}
        if call.get("id") or self._open is None or self._open["type"] != "function_call" or \
                call.get("index") != self._call_index:
            events += self._close() + self._start({"type": "function_call", "call_id": call.get("id") or "",
                                                   "name": function.get("name") or ""})
            self._call_index = call.get("index")
        arguments = function.get("arguments") or ""
        if arguments:
            self._text += arguments
            events.append({"type": "response.function_call_arguments.delta", **self._position(), "delta": arguments})
        return events

    def _position(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict) -> list[dict]:
        kind = item["type"]
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        self._open, self._text = {"id": new_response_id(prefix), **item}, ""
        self.items.append(self._open)
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": self._item("in_progress")}]
        if kind != "function_call":
            events.append({"type": "response.content_part.added", **self._position(), "content_index": 0,
                           "part": _part(kind, "")})
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        kind, item, text = self._open["type"], self._position(), self._text
        if kind == "message":
            events = [{"type": "response.output_text.done", **item, "content_index": 0, "text": text, "logprobs": []}]
        elif kind == "reasoning":
            events = [{"type": "response.reasoning_text.done", **item, "content_index": 0, "text": text}]
        else:
            events = [{"type": "response.function_call_arguments.done", **item, "arguments": text}]
        if kind != "function_call":
            events.append({"type": "response.content_part.done", **item, "content_index": 0, "part": _part(kind, text)})
        self.items[-1] = done = self._item(status)
        events.append({"type": "response.output_item.done", "output_index": item["output_index"], "item": done})
        self._open = None
        return events

    def _item(self, status: str) -> dict:
        """The open item as OpenAI writes it, with ``status`` and the text so far."""
        item, text = self._open, self._text
        if item["type"] == "message":
            content = [_part("message", text)] if status != "in_progress" else []
            return {"id": item["id"], "type": "message", "status": status, "role": "assistant", "content": content}
        if item["type"] == "reasoning":
            content = [_part("reasoning", text)] if status != "in_progress" else []
            return {"id": item["id"], "type": "reasoning", "summary": [], "content": content, "status": status}
        return {"id": item["id"], "type": "function_call", "status": status, "call_id": item["call_id"],
                "name": item["name"], "arguments": text if status != "in_progress" else ""}


def _part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


# ---- the route ------------------------------------------------------------------------------------------------
class StoredResponses:
    """A router's stored responses (``store``) and the background ones still running, whatever model made
    them: GET, DELETE and cancel of /v1/responses/{id} need no model."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore(0, 0)
        self.running: dict[tuple[str | None, str], tuple[asyncio.Task, _Run]] = {}

    def retrieve(self, owner: str | None, response_id: str) -> dict:
        return self.stored(owner, response_id, "response_id").body

    def delete(self, owner: str | None, response_id: str) -> dict:
        """Forgets a stored response (a background one still running is cancelled first)."""
        running = self._stop(owner, response_id) is not None
        if not self.store.delete(owner, response_id) and not running:
            raise not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, owner: str | None, response_id: str) -> dict:
        """A background response cancelled (its generation aborted), or as it ended if it already had; a response
        that was not created in the background cannot be cancelled (400), as OpenAI answers."""
        stopped = self._stop(owner, response_id)
        if stopped is not None:
            task, run = stopped
            await asyncio.gather(task, return_exceptions=True)
            self.store.put(owner, response_id, {**run.body, "status": "cancelled", "output": []}, [],
                           run.input_items)
        body = self.stored(owner, response_id, "response_id").body
        if not body.get("background"):
            raise bad_request("Cannot cancel a synchronous response.", param="response_id")
        return body

    def input_items(self, owner: str | None, response_id: str, limit: int = 20, order: str = "desc",
                    after: str | None = None, before: str | None = None) -> dict:
        """A page of a stored response's input items, as OpenAI lists them: ``order`` asc or desc, the items after
        (or before) the item ``after`` (``before``) in that order, at most ``limit`` (1 to 100)."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise bad_request(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be asc or desc, got {order!r}", param="order")
        items = self.stored(owner, response_id, "response_id").input_items
        items = items if order == "asc" else items[::-1]
        ids = [item["id"] for item in items]
        for cursor, param in ((after, "after"), (before, "before")):
            if cursor is not None and cursor not in ids:
                raise bad_request(f"no input item {cursor!r} in response {response_id!r}", param=param)
        start = ids.index(after) + 1 if after is not None else 0
        stop = ids.index(before) if before is not None else len(items)
        page = items[start:stop][:limit] if before is None else items[start:stop][-limit:]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": (start + limit < stop) if before is None else (stop - start > limit)}

    def stored(self, owner: str | None, response_id: str, param: str) -> StoredResponse:
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise not_found(response_id, param)
        return entry

    def _stop(self, owner: str | None, response_id: str) -> tuple[asyncio.Task, _Run] | None:
        """Cancels a running background response's task and aborts its request: (task, run), or None if none
        was running (not one of this owner's, or already ended: it then stored how it ended)."""
        running = self.running.pop((owner, response_id), None)
        if running is None or not running[0].cancel():  # cancel() is False once the task has ended
            return None
        running[1].stream.abort()  # the task may never have started: its merge() would abort on exit
        return running


class ResponsesServing(ChatServing):
    """/v1/responses over the chat route's preparation (``_prepare``) and output parsing (``_choice_text``)."""

    def __init__(self, engine, served_model_names, limits=None, chat_template=None, options=None, *,
                 prompt_tokens_details: bool = False, responses: StoredResponses | None = None,
                 adapters=None) -> None:
        super().__init__(engine, served_model_names, limits, chat_template, options,
                         prompt_tokens_details=prompt_tokens_details, adapters=adapters)
        self.responses = responses if responses is not None else StoredResponses()

    async def create(self, req: ResponsesRequest, owner: str | None = None) -> dict | StreamingResult:
        """The Response object, or a StreamingResult of its events for ``stream``. Raises before anything runs if
        the request is bad."""
        run = await self._start(req, owner)
        if req.background:
            return self._run_in_background(run)
        if req.stream:
            return StreamingResult(self._stream(run), [run.stream])
        async for _ in run.events():
            pass
        return run.body

    # ---- one response --------------------------------------------------------------------------------------
    async def _start(self, req: ResponsesRequest, owner: str | None) -> _Run:
        """Checks and submits the request: a 4xx before anything runs if it is bad."""
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = self.responses.stored(owner, req.previous_response_id, "previous_response_id")
            if previous.body["status"] not in FINISHED:
                raise bad_request(f"response {req.previous_response_id!r} is {previous.body['status']}: only a "
                                  "completed or incomplete response can be continued", param="previous_response_id")
            history = previous.messages
        unsupported = req.unsupported() or req.refused_extra()
        if unsupported is not None:
            raise bad_request(unsupported[1], param=unsupported[0], code="unsupported_parameter")
        req.log_unknown_fields()  # (the chat request built from it carries no unknown fields)
        if req.input is None or isinstance(req.input, str):
            items = [] if req.input is None else [{"type": "message", "role": "user", "content": req.input}]
        else:
            items = req.input
        origins: list[str] = []
        try:
            new_messages, origins = conversation(items)
            if not new_messages:
                raise bad_request("input needs at least one message", param="input")
            system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
            messages = system + history + new_messages
            origins = ["instructions"] * len(system) + ["previous_response_id"] * len(history) + origins
            chat_req = chat_request(req, messages)
            model, tool_choice, params, processed = await self._prepare(chat_req)
        except (OpenAIError, ValidationError) as e:
            raise renamed(from_exception(e), origins) from e
        response_id = new_response_id("resp")
        body = self._skeleton(req, response_id, model, params)
        stream = self.submit(response_id, [processed], params, chat_req)[0]
        return _Run(self, owner, req, body, history + new_messages, self._choice_text(chat_req, tool_choice), stream)

    def _skeleton(self, req: ResponsesRequest, response_id: str, model: str, params) -> dict:
        """The Response object before any output: the request's settings as OpenAI echoes them."""
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": response_id, "object": "response", "created_at": now(), "status": "in_progress",
            "background": bool(req.background), "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "metadata": req.metadata or {}, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "service_tier": "default", "store": req.store is not False, "temperature": params.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                     "verbosity": (req.text.verbosity if req.text else None) or "medium"},
            "tool_choice": req.tool_choice or "auto", "tools": [t.model_dump() for t in req.tools or ()],
            "top_logprobs": req.top_logprobs or 0, "top_p": params.top_p, "truncation": "disabled", "usage": None,
            "user": req.user, "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier}

    async def _stream(self, run: _Run) -> AsyncIterator[str]:
        sequence = 0
        async for event in run.events():
            yield f"event: {event['type']}\ndata: {_json({**event, 'sequence_number': sequence})}\n\n"
            sequence += 1

    def _run_in_background(self, run: _Run) -> dict:
        """Stores the queued response and generates it in a task of its own (not the HTTP request's)."""
        key = (run.owner, run.body["id"])
        run.body = {**run.body, "status": "queued"}
        self.responses.store.put(run.owner, run.body["id"], run.body, [], run.input_items)
        task = asyncio.get_running_loop().create_task(self._background_task(run))
        self.responses.running[key] = (task, run)
        task.add_done_callback(lambda _: self.responses.running.pop(key, None))
        return run.body

    @staticmethod
    async def _background_task(run: _Run) -> None:
        async for _ in run.events():  # stores the response when it ends (cancel() stores a cancelled one)
            pass


class _Run:
    """One submitted response: its stream read into output items (and events), then finished and stored."""

    def __init__(self, serving: ResponsesServing, owner: str | None, req: ResponsesRequest, body: dict,
                 conversation_so_far: list[dict], text, stream) -> None:
        self.serving, self.owner, self.req, self.body = serving, owner, req, body
        self.input_items = listed_input(req)
        self.conversation, self.text, self.stream = conversation_so_far, text, stream
        self.output = OutputItems()
        self.num_output_tokens = self.num_reasoning_tokens = 0
        self._content_seen = False

    async def events(self) -> AsyncIterator[dict]:
        """The response's stream events, from response.created to its end; the body is final (and stored) by the
        last one. An engine failure ends it as response.failed."""
        yield {"type": "response.created", "response": self.body}
        yield {"type": "response.in_progress", "response": self.body}
        final: RequestOutput | None = None
        try:
            async for _, out in merge([self.stream]):
                for event in self._feed(out):
                    yield event
                if out.finished:
                    final = out
        except Exception as e:  # the engine failed mid-way: the response fails, in-band when streamed
            error = from_exception(e)
            self.body = {**self.body, "status": "failed", "output": [],
                         "error": {"code": error.code or "server_error", "message": error.message}}
            self._store()
            yield {"type": "response.failed", "response": self.body}
            return
        reason = final.outputs[0].finish_reason if final is not None and final.outputs else None
        status = {"length": "incomplete", "abort": "cancelled"}.get(reason, "completed")
        for event in self.output.finish(status if status == "completed" else "incomplete"):
            yield event
        self.body = self._finished(final, status)
        self._store()
        yield {"type": f"response.{'incomplete' if status == 'incomplete' else 'completed'}", "response": self.body}

    def _feed(self, out: RequestOutput) -> list[dict]:
        events: list[dict] = []
        for c in out.outputs:
            delta = self.text.feed(c.delta_text) if c.delta_text else {}
            if c.finish_reason is not None:
                events += self.output.add(delta)
                delta = self.text.finish()
            events += self.output.add(delta)
            self.num_output_tokens += len(c.delta_token_ids)
            # Reasoning tokens: those written before the first content or call (the end marker included).
            if self.serving.reasoning_parser is not None and not self._content_seen:
                self._content_seen = any(item["type"] != "reasoning" for item in self.output.items)
                if not self._content_seen:
                    self.num_reasoning_tokens += len(c.delta_token_ids)
        return events

    def _finished(self, final: RequestOutput, status: str) -> dict:
        body = {**self.body, "status": status, "output": self.output.items}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "completed":
            body["completed_at"] = now()
        counts = usage([final], self.num_output_tokens, self.serving.prompt_tokens_details)
        body["usage"] = {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                         "total_tokens": counts["total_tokens"],
                         "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens}}
        if "prompt_tokens_details" in counts:
            body["usage"]["input_tokens_details"] = counts["prompt_tokens_details"]
        return body

    def _store(self) -> None:
        if self.req.store is False:
            return
        output_messages, _ = conversation(self.body["output"], "output")
        self.serving.responses.store.put(self.owner, self.body["id"], self.body, self.conversation + output_messages,
                                         self.input_items)


def not_found(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")


def _json(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
