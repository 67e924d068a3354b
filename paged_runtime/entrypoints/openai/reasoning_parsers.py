"""Reasoning parsers: a model's text in, (reasoning, content) out, for ``--reasoning-parser``.

Pure text work (no engine, no HTTP). Both formats mark reasoning with ``<think>`` ... ``</think>``:

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output may start
  inside it. Everything before ``</think>`` is reasoning (a leading ``<think>`` dropped), what
  follows is content; with no ``</think>`` at all the whole text is reasoning and content None
  (vLLM's behaviour: the model was cut off while thinking).
- ``qwen3``: reasoning only inside an explicit ``<think>``; text before it and after ``</think>``
  is content; no ``<think>`` means all content. An unclosed ``<think>`` (the model was cut off
  while thinking) is reasoning to the end: holding it back to see whether ``</think>`` ever comes
  would stall a stream for the whole thought, and streaming must agree with ``extract``.

Empty parts are None. Streaming (``parser.stream()``) agrees with ``extract``: for any split of the
text into deltas, the reasoning deltas joined equal ``extract``'s reasoning (or "") and the content
deltas its content (or ""). A marker split across deltas is held until it is resolved.

Both follow from one function per format, ``_split(text, final)``: the (reasoning, content) settled
so far, each a prefix of the final one; a stream emits what each call adds.

``reasoning_ended(text)`` says whether the text (prompt and output so far) has closed its
reasoning section, so constraints (structured outputs, tool calls) start after it; vLLM checks
the prompt too, where Qwen3's template writes an empty ``<think></think>`` when thinking is off.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from paged_runtime.entrypoints.openai.tool_parsers import partial_marker_len


class ReasoningDelta(NamedTuple):
    reasoning: str  # "" when the delta adds none
    content: str


class ReasoningParser:
    """Base: ``extract`` for a whole response, ``stream`` for deltas; a format implements ``_split``."""

    name: ClassVar[str] = ""
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) settled in ``text``; with ``final`` the text is complete. Each part is a
        prefix of the same part for any longer text."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self._split(text, final=True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def reasoning_ended(self, text: str) -> bool:
        """True when ``text`` closes its last reasoning section: a ``</think>`` after the last ``<think>``."""
        return text.rfind(self.end_marker) > text.rfind(self.start_marker)

    def end_token_ids(self, tokenizer: Any) -> list[int]:
        """The token ids of ``</think>`` (one special token in these models' vocabularies)."""
        return list(tokenizer.encode(self.end_marker, add_special_tokens=False))

    def _held(self, text: str, marker: str, final: bool) -> str:
        """``text`` less a tail that may be the start of ``marker`` (nothing is held once the text is final)."""
        return text if final else text[:len(text) - partial_marker_len(text, marker)]


class ReasoningStream:
    """One choice's deltas through a parser: ``feed`` each delta, then ``finish`` once."""

    def __init__(self, parser: ReasoningParser):
        self._parser = parser
        self._text = ""
        self._sent = ("", "")  # reasoning and content emitted so far

    def feed(self, delta_text: str) -> ReasoningDelta:
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning, content = self._parser._split(self._text, final)
        sent_reasoning, sent_content = self._sent
        assert reasoning.startswith(sent_reasoning) and content.startswith(sent_content)  # _split's contract
        self._sent = (reasoning, content)
        return ReasoningDelta(reasoning[len(sent_reasoning):], content[len(sent_content):])


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        head = text.lstrip()
        if not final and self.start_marker.startswith(head):
            return "", ""  # blank, or the start of a leading <think>: not yet known whether to drop it
        body = head[len(self.start_marker):] if head.startswith(self.start_marker) else text
        reasoning, end, content = body.partition(self.end_marker)
        return (reasoning, content) if end else (self._held(reasoning, self.end_marker, final), "")


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        before, start, rest = text.partition(self.start_marker)
        if not start:
            return "", self._held(before, self.start_marker, final)
        reasoning, end, after = rest.partition(self.end_marker)
        return (reasoning, before + after) if end else (self._held(reasoning, self.end_marker, final), before)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser ``--reasoning-parser name`` selects; ValueError naming the known ones otherwise."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()
