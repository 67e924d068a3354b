"""One chat choice's text as OpenAI's message: reasoning, content and tool calls, whole or delta by delta.

Order of the split: the reasoning parser (``--reasoning-parser``) takes ``<think>...</think>`` off first
(``reasoning_content``); what follows is content, which a tool choice may turn into calls:

- a named choice: the content is the arguments (constrained), streamed as argument deltas of call 0;
- ``"required"``: the content is a JSON array of calls (constrained), each sent whole once it is complete;
- ``"auto"``: the server's tool parser finds calls in the content; what it cannot parse stays content.

Streaming and whole responses go through the same parsers, so the deltas of a stream put together equal
the whole response (call ids aside).
"""
from __future__ import annotations

import json

from paged_runtime.entrypoints.openai.tool_calls import ToolChoice, forced_calls, new_call_id, tool_call


class ChoiceText:
    """Parses one choice's output. ``whole(text)`` for a full response, ``feed(delta)`` per streamed delta
    then ``finish()``; ``tools_called`` says whether calls were emitted."""

    def __init__(self, choice: ToolChoice, tool_parser=None, reasoning_parser=None,
                 include_reasoning: bool = True) -> None:
        """``include_reasoning`` False: the reasoning is split off and dropped (vLLM's request field)."""
        self.choice, self.tool_parser, self.reasoning_parser = choice, tool_parser, reasoning_parser
        self.include_reasoning = include_reasoning
        self.tools_called = False
        self._reasoning_stream = reasoning_parser.stream() if reasoning_parser is not None else None
        self._tool_stream = tool_parser.stream() if choice.mode == "auto" and tool_parser is not None else None
        self._named_id: str | None = None
        self._array = _ArrayCalls() if choice.mode == "required" else None

    # ---- whole ---------------------------------------------------------------------------------------
    def whole(self, text: str) -> dict:
        """The message's fields besides the role: content, reasoning_content, tool_calls."""
        reasoning, content = self.reasoning_parser.extract(text) if self.reasoning_parser else (None, text)
        message = {"content": content}
        if self.reasoning_parser is not None and self.include_reasoning:
            message["reasoning_content"] = reasoning
        calls = None
        if self.choice.forced and content is not None:
            calls = forced_calls(self.choice, content)
        elif self.choice.mode == "auto" and self.tool_parser is not None and content is not None:
            extracted = self.tool_parser.extract(content)
            if extracted.tool_calls:
                calls = [tool_call(c.name, c.arguments, c.id) for c in extracted.tool_calls]
                message["content"] = extracted.content
        if calls:
            self.tools_called = True
            message["tool_calls"] = calls
            if self.choice.forced:
                message["content"] = None
        return message

    # ---- streaming -------------------------------------------------------------------------------------
    def feed(self, delta: str) -> dict:
        """The delta message for ``delta`` (possibly empty: the parsers may hold text back)."""
        reasoning, content = self._reasoning_stream.feed(delta) if self._reasoning_stream else ("", delta)
        return self._delta(reasoning, content, final=False)

    def finish(self) -> dict:
        """What the parsers still held, at the end of the output."""
        reasoning, content = self._reasoning_stream.finish() if self._reasoning_stream else ("", "")
        return self._delta(reasoning, content, final=True)

    def _delta(self, reasoning: str | None, content: str | None, final: bool) -> dict:
        out: dict = {}
        if reasoning and self.include_reasoning:
            out["reasoning_content"] = reasoning
        content = content or ""
        calls: list[dict] = []
        if self.choice.mode == "named":
            calls = self._named(content, final)
            content = ""
        elif self._array is not None:
            calls, content = self._array.feed(content), ""
        elif self._tool_stream is not None:
            step = self._tool_stream.feed(content) if not final else _joined(self._tool_stream.feed(content),
                                                                             self._tool_stream.finish())
            content = step.content
            calls = [{"index": d.index, "id": d.id, "type": "function",
                      "function": {"name": d.name, "arguments": d.arguments}} for d in step.tool_calls]
        if content:
            out["content"] = content
        if calls:
            self.tools_called = True
            out["tool_calls"] = calls
        return out

    def _named(self, arguments: str, final: bool) -> list[dict]:
        if not arguments:
            return []
        call = {"index": 0, "function": {"arguments": arguments}}
        if self._named_id is None:  # the first delta of the call names it
            self._named_id = new_call_id()
            call = {"index": 0, "id": self._named_id, "type": "function",
                    "function": {"name": self.choice.tool.function.name, "arguments": arguments}}
        return [call]


class _ArrayCalls:
    """A ``"required"`` choice's JSON array of calls, read as it streams: each call is emitted once its
    object is complete. What never completes (output cut short) is dropped: the whole response then has
    no calls either."""

    def __init__(self) -> None:
        self.text, self.position, self.index = "", None, 0
        self.decoder = json.JSONDecoder()

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        calls = []
        while True:
            start = self._next_element()
            if start is None:
                return calls
            try:
                value, end = self.decoder.raw_decode(self.text, start)
            except ValueError:
                return calls
            self.position = end
            if isinstance(value, dict) and "name" in value and "parameters" in value:
                call = tool_call(value["name"], json.dumps(value["parameters"], ensure_ascii=False))
                calls.append({"index": self.index, **call})
                self.index += 1

    def _next_element(self) -> int | None:
        """Where the next element starts, or None if it has not begun (or the array has ended)."""
        if self.position is None:
            opening = self.text.find("[")
            if opening < 0:
                return None
            self.position = opening + 1
        rest = self.text[self.position:]
        stripped = rest.lstrip(" \n\t\r,")
        if not stripped or stripped[0] == "]":
            return None
        return self.position + len(rest) - len(stripped)


def _joined(first, second):
    """Two tool-stream steps as one (content and calls in order)."""
    first.content = (first.content or "") + (second.content or "")
    first.tool_calls = list(first.tool_calls) + list(second.tool_calls)
    return first
