"""POST /v1/completions: prompts (text or token ids, one or many) in, completions or an SSE stream out.

Choice ``index`` is ``prompt_index * n + sequence_index``, as in vLLM. With
``echo`` the prompt's text (and, with ``logprobs``, its logprobs, the first
position's being null) precedes each choice's text. ``prompt_logprobs`` adds
vLLM's ``prompt_logprobs`` list to each choice (not when streaming).

Scoring (vLLM's ``echo`` with ``max_tokens: 0``): each choice is the prompt
alone, with its logprobs when ``logprobs`` is set, finish_reason "length"
and no completion tokens in the usage. The engine always generates at least
one token (its scheduler, runner and stop logic are built on that), so the
route runs the prompt with ``max_tokens: 1`` and drops that token: the prompt
logprobs need the same prefill anyway, and the one extra decode position is
cheaper than an engine mode where a request may finish without a step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from paged_runtime.engine.client import RequestStream
from paged_runtime.entrypoints.openai.constraints import request_constraint
from paged_runtime.entrypoints.openai.errors import bad_request
from paged_runtime.entrypoints.openai.protocol import CompletionRequest
from paged_runtime.entrypoints.openai.serving import (SSE_DONE, OpenAIServing, StreamingResult, clamp, collect_deltas,
                                                     merge, new_id, now, prompt_logprobs_body, render_body, sse, sse_error,
                                                     usage)
from paged_runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from paged_runtime.engine.processor import ProcessedPrompt
from paged_runtime.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Logprobs:
    """OpenAI's legacy logprobs object, built position by position."""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0

    def add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def add_positions(self, token_ids: list[int], entries: list[PositionLogprobs]) -> None:
        for token_id, entry in zip(token_ids, entries):
            chosen = entry[token_id]
            self.add(chosen.decoded_token or "", clamp(chosen.logprob),
                     {lp.decoded_token or "": clamp(lp.logprob) for lp in entry.values()})

    def take(self) -> dict:
        """The positions added since the last take (a streaming chunk's share)."""
        body = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest) -> dict | StreamingResult:
        """The response body, or a StreamingResult for ``stream``. Raises before anything runs if the request is bad."""
        model, params, processed = await self._prepare(req)
        request_id = new_id("cmpl")
        streams = self.submit(request_id, processed, params, req)
        if req.stream:
            return StreamingResult(self._stream(req, request_id, model, streams), streams)
        outputs = await collect_deltas(streams)
        return self._response(req, request_id, model, [_scored(o) for o in outputs] if req.max_tokens == 0 else outputs)

    async def render_request(self, req: CompletionRequest) -> list[dict]:
        """What ``create`` would submit, one vLLM ``GenerateRequest`` body per prompt, without generating."""
        model, params, processed = await self._prepare(req)
        return [render_body(new_id("cmpl"), prompt, params, req, model) for prompt in processed]

    async def _prepare(self, req: CompletionRequest) -> tuple[str, SamplingParams, list[ProcessedPrompt]]:
        """(the model name to echo, the sampling parameters, each prompt tokenized and checked)."""
        model = self.resolve_model(req.model)
        self.check_common(req)
        if req.stream and req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n when streaming", param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                              param="max_tokens", code="invalid_value")
        scoring = req.max_tokens == 0
        echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        constraint, source = request_constraint(req)
        params = self.sampling_params(req, 1 if scoring else req.max_tokens, req.logprobs, best_of=req.best_of,
                                      prompt_logprobs=echo_logprobs, fields={"structured_outputs": source},
                                      structured_outputs=constraint)
        # Each step's delta, never a copy of the sequence; whole responses put the deltas together (not
        # FINAL_ONLY: the step loop takes its time-to-first-token and inter-token metrics from each output).
        # best_of > n cannot stream (refused above) and has no deltas: its whole response comes at the end.
        kind = RequestOutputKind.DELTA if params.best_of == params.n else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(params, output_kind=kind)
        prompts = self.prompt_list(req.prompt, "prompt")
        return model, params, [await self.process_off_loop(p, params, "prompt", source) for p in prompts]

    # ---- whole response ------------------------------------------------------------------
    def _response(self, req: CompletionRequest, request_id: str, model: str, outputs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            prefix = self._prompt_text(out) if req.echo else ""
            for c in out.outputs:
                logprobs = self._logprobs(req, out, c.token_ids, c.logprobs or [], echo=req.echo)
                choice = {"index": i * req.n + c.index, "text": prefix + c.text,
                          "logprobs": logprobs.take() if logprobs else None,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_body(out, req.prompt_logprobs)
                choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
                "choices": choices, "usage": usage(outputs, sum(len(c.token_ids) for o in outputs for c in o.outputs),
                                                     self.prompt_tokens_details)}

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(self, req: CompletionRequest, out: RequestOutput, token_ids: list[int],
                  entries: list[PositionLogprobs], echo: bool, into: _Logprobs | None = None) -> _Logprobs | None:
        if req.logprobs is None:
            return None
        lp = into or _Logprobs()
        if echo:
            self._add_prompt_positions(lp, out, req.logprobs)
        lp.add_positions(token_ids, entries)
        return lp

    def _add_prompt_positions(self, lp: _Logprobs, out: RequestOutput, top_n: int) -> None:
        """The prompt's positions, each with its ``top_n`` most likely tokens (the engine computed
        max(logprobs, prompt_logprobs) of them)."""
        entries = out.prompt_logprobs or []
        for pos, token_id in enumerate(out.prompt_token_ids):
            entry = entries[pos] if pos < len(entries) else None
            if entry is None or token_id not in entry:  # the first position has no logprob
                lp.add(self.engine.tokenizer.decode([token_id]), None, None)
            else:
                kept = {t: e for t, e in entry.items() if t == token_id or (e.rank is not None and e.rank <= top_n)}
                lp.add_positions([token_id], [kept])

    # ---- streaming ---------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, request_id: str, model: str,
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        created, finished_outputs = now(), []
        state = _StreamState()
        try:
            async for i, out in merge(streams):
                out = _scored(out) if req.max_tokens == 0 else out
                state.num_completion_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
                choices = [choice for c in out.outputs
                           if (choice := self._delta_choice(req, state, i, out, c)) is not None]
                if out.finished:
                    finished_outputs.append(out)
                if choices:
                    yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                               "choices": choices})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage(finished_outputs, state.num_completion_tokens,
                                                        self.prompt_tokens_details)})
        except Exception as e:  # the engine failed mid-stream: tell the client in-band
            yield sse_error(e)
        finally:
            for stream in streams:
                stream.abort()
        yield SSE_DONE

    def _delta_choice(self, req: CompletionRequest, state: _StreamState, i: int, out: RequestOutput,
                      c: CompletionOutput) -> dict | None:
        index = i * req.n + c.index
        if index in state.finished:
            return None
        first = index not in state.started
        text = (self._prompt_text(out) if req.echo and first else "") + c.delta_text
        has_logprobs = req.logprobs is not None and (c.delta_token_ids or (req.echo and first))
        if not text and c.finish_reason is None and not has_logprobs:
            return None  # nothing to say yet (the detokenizer may be holding back a partial character)
        state.started.add(index)
        logprobs = None
        if req.logprobs is not None:
            lp = state.logprobs.setdefault(index, _Logprobs())
            logprobs = self._logprobs(req, out, c.delta_token_ids, c.delta_logprobs, req.echo and first, lp).take()
        if c.finish_reason is not None:
            state.finished.add(index)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


@dataclass
class _StreamState:
    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    logprobs: dict[int, _Logprobs] = field(default_factory=dict)  # keeps each choice's running text offset
    num_completion_tokens: int = 0  # outputs are deltas: the usage chunk's count is their sum


def _scored(out: RequestOutput) -> RequestOutput:
    """Scoring mode's output: the one token generated to run the prompt dropped from every sequence."""
    if not out.finished:
        return dataclasses.replace(out, outputs=[])
    reason = lambda c: "length" if c.finish_reason in ("stop", "length") else c.finish_reason  # abort, error stay
    empty = [CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None, reason(c), None)
             for c in out.outputs]
    return dataclasses.replace(out, outputs=empty)

