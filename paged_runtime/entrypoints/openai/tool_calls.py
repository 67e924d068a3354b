"""Chat tool calling: which tool choice a request makes, the constraint a forced choice runs under, and the
``tool_calls`` a response carries.

- ``"none"``: plain content (the tools still reach the chat template, as in vLLM).
- ``"auto"`` (OpenAI's default when tools are given): the model decides; its text is parsed by the server's
  ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``, as in vLLM); text that does not parse is content.
- ``"required"``: the output is constrained to a JSON array of ``{"name": ..., "parameters": {...}}`` with
  one entry per call, each validated against its tool's schema, so the calls always parse.
- a named function: the output is constrained to that tool's parameters schema: the arguments themselves.

``finish_reason`` is ``"tool_calls"`` when an auto or required response calls tools; a named choice finishes
with ``"stop"``, as OpenAI's does.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from paged_runtime.entrypoints.openai.errors import bad_request
from paged_runtime.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from paged_runtime.sampling_params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    tool: ChatTool | None = None  # the named tool

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def resolve_tool_choice(req: ChatCompletionRequest, auto_enabled: bool) -> ToolChoice:
    """The request's tool choice, checked against its tools and this server; a 400 naming the field."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolChoice("none")
    if isinstance(choice, dict):
        return ToolChoice("named", _named_tool(req.tools, choice))
    mode = choice or "auto"
    if mode == "auto" and not auto_enabled:
        raise bad_request('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                          '--tool-call-parser; use tool_choice "required", "none" or a named function',
                          param="tool_choice")
    return ToolChoice(mode)


def tool_constraint(req: ChatCompletionRequest, choice: ToolChoice) -> StructuredOutputsParams | None:
    """The output constraint of a forced tool choice (None otherwise)."""
    if choice.mode == "named":
        return StructuredOutputsParams(json=choice.tool.function.parameters or ANY_OBJECT)
    if choice.mode != "required":
        return None
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                         "parameters": t.function.parameters or ANY_OBJECT},
                        "required": ["name", "parameters"]} for t in req.tools]}
    schema = {"type": "array", "minItems": 1, "items": calls}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """One entry of a message's ``tool_calls`` (OpenAI's shape; ``arguments`` is JSON text)."""
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def forced_calls(choice: ToolChoice, text: str) -> list[dict] | None:
    """The calls in a forced choice's (constrained) output; None when it does not parse (cut short by
    max_tokens): the text is then returned as content."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if choice.mode == "named":
        return [tool_call(choice.tool.function.name, text)]  # as streamed: the output is the arguments
    return [tool_call(call["name"], _compact(call["parameters"])) for call in value]


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _named_tool(tools: list[ChatTool], choice: dict) -> ChatTool:
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                          param="tool_choice")
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise bad_request(f"tool_choice names {name!r}, which is not among the tools: "
                      f"{', '.join(t.function.name for t in tools)}", param="tool_choice")
