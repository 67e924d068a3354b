"""The synchronous engine: text in, text out, one step at a time.

Wraps the token-level ``EngineCore`` with the processor (tokenize, validate)
on the way in and incremental detokenization plus stop strings on the way
out. A stop string ends its request in the same step it appears.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

from paged_runtime.config import EngineConfig
from paged_runtime.engine.core import EngineCore
from paged_runtime.engine.detokenizer import IncrementalDetokenizer
from paged_runtime.engine.processor import ProcessedPrompt, Processor, PromptType
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.loader import load_tokenizer, resolve_model_path
from paged_runtime.outputs import CompletionOutput, RequestOutput
from paged_runtime.request import Request, RequestStatus
from paged_runtime.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        model_config = ModelConfig.from_folder(self.model_path)
        self.core = EngineCore(config, self.model_path, model_config)
        self.tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else self.model_path)
        self.max_model_len = self.core.max_model_len
        self.processor = Processor(self.tokenizer, self.max_model_len, model_config.vocab_size)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, self.model_path, model_config)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()

    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request; a prompt already validated by ``self.processor`` is taken as it is."""
        if request_id in self.detokenizers:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.processor.process(prompt, params)
        request = Request(request_id, processed.token_ids, params, next(self._arrivals), processed.max_tokens,
                          self.eos_token_ids, processed.prompt, priority, cache_salt)
        self.core.add_request(request)
        self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, processed.token_ids, params)

    def abort_request(self, request_ids: list[str]) -> None:
        for request in self.core.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self.detokenizers.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return [self._make_output(r) for r in self.core.step()]

    def _make_output(self, request: Request) -> RequestOutput:
        detok = self.detokenizers[request.request_id]
        token_id = request.all_token_ids[-1]
        ended_by_token = request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None
        hidden = ended_by_token or (request.stop_reason == token_id
                                    and not request.params.include_stop_str_in_output)
        if not hidden:
            stop = detok.add_tokens([token_id])
            if stop is not None and not request.status.finished:
                self.core.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.stop_reason = stop
        finished = request.status.finished
        if finished:
            del self.detokenizers[request.request_id]
        completion = CompletionOutput(0, detok.text, list(request.output_token_ids), request.finish_reason,
                                      request.stop_reason)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion], finished,
                             num_cached_tokens=max(0, request.num_cached_tokens), delta_text=detok.take_delta(finished), delta_token_ids=[token_id])


def _eos_token_ids(tokenizer, model_path: Path, model_config: ModelConfig) -> frozenset[int]:
    ids = set()
    for source in (tokenizer.eos_token_id, model_config.eos_token_id, _generation_eos(model_path)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)


def _generation_eos(model_path: Path):
    path = model_path / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
