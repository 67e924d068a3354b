"""Offline batch inference with vLLM's ``LLM`` interface, over ``LLMEngine``'s declared methods only."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from paged_runtime.config import EngineConfig
from paged_runtime.engine.beam_search import BeamSearchOutput, BeamSearchParams
from paged_runtime.engine.llm_engine import LLMEngine
from paged_runtime.engine.processor import PromptType
from paged_runtime.lora.request import LoRARequest
from paged_runtime.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from paged_runtime.pooling_params import PoolingParams
from paged_runtime.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """``LLM()`` serves the embedded SmolLM2-135M-Instruct; ``LLM(model=path, ...)`` any Llama-family model."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if "task" in kwargs:  # vLLM's older spelling of runner (task="embed": runner="pooling")
            kwargs.setdefault("runner", kwargs.pop("task"))
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's recommended sampling (its generation_config.json, unless the engine was built with
        ``generation_config="vllm"``) over SamplingParams' own defaults; what ``generate`` and ``chat`` use
        when given no ``sampling_params``."""
        return SamplingParams(**self.engine.default_sampling)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their KV)."""
        self.engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. ``lora_request``: the adapter of
        every prompt, or one per prompt (None: the base model); needs ``LLM(enable_lora=True)``."""
        if self.engine.config.is_pooling:
            raise ValueError("LLM.generate needs a generative model; this one runs with runner='pooling': use embed")
        prompts = _prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), self.get_default_sampling_params)
        priority = list(priority) if priority is not None else [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        adapters = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} lora_requests for {len(prompts)} prompts")
        for adapter in dict.fromkeys(a for a in adapters if a is not None):
            self.engine.add_lora(adapter)  # an adapter that cannot run is refused before anything is queued
        return self._run(list(zip(prompts, params, priority)), use_tqdm, adapters=adapters)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding (``runner="pooling"``), in input order. The pooling type is the
        engine's (``pooling_type``); ``pooling_params`` may set ``dimensions`` and ``normalize``."""
        if not self.engine.config.is_pooling:
            raise ValueError("LLM.embed needs a pooling model: build the LLM with runner='pooling'")
        prompts = _prompt_list(prompts)
        asked = pooling_params or PoolingParams(normalize=self.engine.config.normalize)
        pooling = self.engine.pooling_params(asked.dimensions, asked.normalize)
        params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        outputs = self._run([(p, params, 0) for p in prompts], use_tqdm, pooling)
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.pooling.data), out.prompt_token_ids)
                for out in outputs]

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search with transformers' semantics; beams are forks inside the engine."""
        greedy = SamplingParams(temperature=0)
        token_ids = [self.engine.process(p, greedy).token_ids for p in prompts]
        results = self.engine.beam_search(token_ids, params)
        for sequences in results:
            for sequence in sequences:
                sequence.text = self.engine.tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        return [BeamSearchOutput(ids, sequences) for ids, sequences in zip(token_ids, results)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template (or ``chat_template``, Jinja text, as vLLM's) to one conversation
        or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self._apply_template(c, add_generation_prompt, chat_template_kwargs,
                                                             chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _apply_template(self, conversation: list[dict], add_generation_prompt: bool, kwargs: dict | None,
                        chat_template: str | None) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not (chat_template or tokenizer.chat_template):
            raise ValueError("this model's tokenizer has no chat template")
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        return tokenizer.encode(text, add_special_tokens=False)

    def _run(self, work: list[tuple[PromptType, SamplingParams, int]], use_tqdm: bool,
             pooling: PoolingParams | None = None, adapters: list[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        # Validate everything first so a bad prompt leaves nothing half-submitted.
        processed = [self.engine.process(p, sp) for p, sp, _ in work]
        request_ids = [f"llm-{next(self._ids)}" for _ in work]
        final_only = _final_only([params for _, params, _ in work])
        adapters = adapters or [None] * len(work)
        for request_id, prompt, (_, params, priority), adapter in zip(request_ids, processed, work, adapters):
            self.engine.add_request(request_id, prompt, final_only[id(params)], priority, pooling=pooling,
                                    lora_request=adapter)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(work), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while len(finished) < len(work):
                    for out in self.engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
                            if out.error is not None:  # the others go on; this output says finish_reason "error"
                                logger.warning("request %s (prompt %d) failed: %s", out.request_id,
                                               request_ids.index(out.request_id), out.error)
            except BaseException:
                self.engine.abort_request([r for r in request_ids if r not in finished])
                raise
        return [finished[r] for r in request_ids]


def _final_only(params: list[SamplingParams]) -> dict[int, SamplingParams]:
    """A FINAL_ONLY copy of each distinct params object (by id): only finished outputs are wanted, so the
    engine builds nothing per step. The caller's objects are left as they are."""
    return {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, a dict, a token-id list) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int,
                default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if params is None:
        return [default()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return list(params)
