"""Tool-call parsers: a model's text in, OpenAI tool calls and the remaining content out.

Pure text work (no engine, no HTTP). One parser per output format, named as vLLM's
``--tool-call-parser`` names them:

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any number, anywhere; the text outside them is content.
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
  optionally after ``<|python_tag|>``, several separated by ``;``; otherwise it is all content.
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects,
  or (newer tokenizers) one or more ``[TOOL_CALLS]name[ARGS]{...}``.

Arguments given as an object become its JSON text (``json.dumps(obj, ensure_ascii=False)``);
arguments given as a JSON string are kept as that string when it parses to a JSON object.

Invariants:

- A parser never raises on a model's output. What it cannot parse stays content: a hermes
  block that does not parse is kept as raw text, a llama3_json or mistral output that does not
  parse is returned whole as content with no calls.
- ``content`` is the text outside the calls, joined, or None when that is empty or whitespace.
- Streaming (``parser.stream()``) agrees with ``extract``: for any split of the text into deltas,
  the content deltas joined equal ``extract(text).content or ""`` and the calls emitted equal its
  calls (names and arguments; ids are fresh). Text that cannot start a call is released at once;
  text that may (a marker, or a prefix of one at the end of what has arrived) is held; a call is
  emitted whole, with its full arguments in one delta, when it is complete.

Both follow from one scan per format, ``_scan(text, start, final)``: it settles what it can of
``text[start:]`` into pieces (content strings and calls) and says how far it got. ``extract`` runs
it once with ``final=True``; a stream runs it on what has arrived and emits the new pieces.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=_call_id)


@dataclass
class ExtractedToolCalls:
    tool_calls: list[ToolCall]
    content: str | None  # the text outside the calls; None when empty or whitespace


@dataclass
class ToolCallDelta:
    """One complete call in a stream: its position among the choice's calls, id, name and full arguments."""
    index: int
    id: str
    name: str
    arguments: str


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# ---- helpers shared by the formats ------------------------------------------------------------------
def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (0 if none):
    the tail a stream must hold because the next delta may complete the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _arguments_text(arguments: Any) -> str | None:
    """The arguments as JSON text, or None when they are not an object (or JSON text of one)."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            return arguments if isinstance(json.loads(arguments), dict) else None
        except (ValueError, RecursionError):
            return None
    return None


def call_from_object(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from a decoded ``{"name": str, <argument key>: {...}}``, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = _arguments_text(obj[key] if key else None)
    return None if arguments is None else ToolCall(obj["name"], arguments)


def _decode_all(text: str, separator: str = "") -> list[Any] | None:
    """The JSON values ``text`` holds (whitespace around them, ``separator`` between them; with no
    separator exactly one value), or None when anything else is there or there is no value at all."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
            return None
        values.append(value)
        rest = text[pos:].lstrip()
        if not rest:
            return values
        if not separator or not rest.startswith(separator):
            return None
        pos = len(text) - len(rest) + len(separator)


def _content(pieces: list) -> str | None:
    text = "".join(p for p in pieces if isinstance(p, str))
    return text if text.strip() else None


# ---- the parsers ------------------------------------------------------------------------------------
class ToolParser:
    """Base: ``extract`` for a whole response, ``stream`` for deltas; a format implements ``_scan``."""

    name: ClassVar[str] = ""
    # The format's markers. Some vocabularies make them special tokens (Mistral's [TOOL_CALLS],
    # Llama's <|python_tag|>), so the route decodes with skip_special_tokens=False while tools are
    # on, as vLLM's parsers ask in adjust_request; otherwise the marker never reaches the parser.
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer  # vLLM's parsers take one; the text formats here do not need it

    def _scan(self, text: str, start: int, final: bool) -> tuple[list, int]:
        """Settle what can be settled of ``text[start:]``: (pieces, end), the pieces covering
        ``text[start:end]`` in order. With ``final`` the text is complete and end is ``len(text)``.
        Pieces settled on a prefix of a text must be the pieces of the whole text there."""
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            pieces, _ = self._scan(text, 0, True)
        except Exception:  # a parser bug must not cost the client its answer
            logger.exception("%s tool parser failed; returning the text as content", self.name)
            return ExtractedToolCalls([], text if text.strip() else None)
        return ExtractedToolCalls([p for p in pieces if isinstance(p, ToolCall)], _content(pieces))

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's deltas through a parser: ``feed`` each delta, then ``finish`` once."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._settled = 0  # text[:settled] has been turned into pieces
        self._calls = 0
        self._blank = ""  # content held while all content so far is whitespace (it may stay None)
        self._content_started = False

    def feed(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        try:
            pieces, self._settled = self._parser._scan(self._text, self._settled, final)
        except Exception:  # as in extract: a parser bug turns the rest into content, never an error
            logger.exception("%s tool parser failed; releasing the text as content", self._parser.name)
            pieces, self._settled = [self._text[self._settled:]], len(self._text)
        out = StreamDelta()
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out.tool_calls.append(ToolCallDelta(self._calls, piece.id, piece.name, piece.arguments))
                self._calls += 1
            elif self._content_started:
                out.content += piece
            else:
                self._blank += piece
                if self._blank.strip():
                    out.content, self._blank, self._content_started = self._blank, "", True
        return out


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def _scan(self, text: str, start: int, final: bool) -> tuple[list, int]:
        pieces, pos = [], start
        while True:
            open_at = text.find(self.OPEN, pos)
            if open_at < 0:
                end = len(text) if final else len(text) - partial_marker_len(text[pos:], self.OPEN)
                pieces.append(text[pos:end])
                return pieces, end
            pieces.append(text[pos:open_at])
            close_at = text.find(self.CLOSE, open_at)
            if close_at < 0 and not final:
                return pieces, open_at  # hold the open block until it closes or the text ends
            # an unclosed last block still counts when its JSON is whole (the model stopped there)
            block_end = len(text) if close_at < 0 else close_at + len(self.CLOSE)
            body = text[open_at + len(self.OPEN):close_at if close_at >= 0 else len(text)]
            pieces.append(self._call(body) or text[open_at:block_end])
            pos = block_end

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        values = _decode_all(body)
        return call_from_object(values[0]) if values else None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)

    def _scan(self, text: str, start: int, final: bool) -> tuple[list, int]:
        if start > 0:  # content was released: the output is not a call, all of it is content
            return [text[start:]], len(text)
        head = text.lstrip()
        may_be_call = head.startswith(("{", self.PYTHON_TAG)) or self.PYTHON_TAG.startswith(head)
        if not final:
            return ([], 0) if may_be_call else ([text], len(text))
        calls = self._calls(head) if may_be_call else None
        return (calls or [text]), len(text)

    def _calls(self, head: str) -> list[ToolCall] | None:
        body = head[len(self.PYTHON_TAG):] if head.startswith(self.PYTHON_TAG) else head
        values = _decode_all(body, separator=";")
        calls = [call_from_object(v, ("parameters", "arguments")) for v in values or []]
        return calls if calls and all(calls) else None


class MistralToolParser(ToolParser):
    name = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (MARKER, ARGS)

    def _scan(self, text: str, start: int, final: bool) -> tuple[list, int]:
        marker_at = text.find(self.MARKER, start)
        if marker_at < 0:
            end = len(text) if final else len(text) - partial_marker_len(text[start:], self.MARKER)
            return [text[start:end]], end
        if not final:
            return [text[start:marker_at]], marker_at  # hold everything from the marker to the end
        calls = self._calls(text[marker_at:])
        if calls is None:  # as vLLM: an output that does not parse is all content
            return [text[start:]], len(text)
        return [text[start:marker_at], *calls], len(text)

    def _calls(self, tail: str) -> list[ToolCall] | None:
        """``tail`` starts with the marker: ``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``
        repeated."""
        calls = []
        for part in tail.split(self.MARKER)[1:]:
            if not part.lstrip().startswith(("[", "{")) and self.ARGS in part:
                name, _, arguments = part.partition(self.ARGS)
                values = _decode_all(arguments)
                found = [call_from_object({"name": name.strip(), "arguments": values[0]}) if values else None]
            else:
                values = _decode_all(part)
                value = values[0] if values else None
                found = [call_from_object(v) for v in (value if isinstance(value, list) else [value])]
            if not found or not all(found):
                return None
            calls += found
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser ``--tool-call-parser name`` selects; ValueError naming the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name](tokenizer)
