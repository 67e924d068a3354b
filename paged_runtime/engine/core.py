"""The engine core: scheduler + model runner, one token-level step at a time.

It knows nothing of text. ``step()`` schedules, runs the forward pass and
returns the requests that received a token (finished ones included).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from paged_runtime.config import EngineConfig, resolve_dtype
from paged_runtime.core.kv_cache_manager import KVCacheManager
from paged_runtime.core.scheduler import Scheduler
from paged_runtime.models.loader import load_model
from paged_runtime.request import Request, RequestStatus
from paged_runtime.worker.kv_budget import free_memory, num_kv_blocks
from paged_runtime.worker.model_runner import ModelRunner, TokenLogprobs
from paged_runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepUpdate:
    """What one step did to one sequence: a new token, and logprobs when asked."""
    request: Request
    token_id: int | None
    logprobs: TokenLogprobs | None
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None


@dataclass(slots=True)
class StepStats:
    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_usage: float
    num_token_slots_used: int  # tokens whose KV is held across running requests (after the step)


class EngineCore:
    def __init__(self, config: EngineConfig, model_path, model_config: ModelConfig) -> None:
        self.config = config
        self.device = config.resolve_device()
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device)
        self.max_model_len = _max_model_len(config, model_config)
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, min(self.max_model_len, 8192))
        model = load_model(model_path, self.max_model_len, self.dtype, self.device)
        budget = config.kv_cache_memory or free_memory(self.device, config.gpu_memory_utilization)
        self.num_blocks = num_kv_blocks(model_config, config.block_size, self.dtype, budget,
                                        self.max_model_len, config.max_num_seqs)
        self.kv_cache = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.scheduling_policy)
        self.runner = ModelRunner(model, self.num_blocks, config.block_size, self.device, self.dtype, config.seed)
        self.last_stats: StepStats | None = None
        logger.info("engine ready: %s %s, %d KV blocks of %d tokens, max_model_len %d",
                    model_config.architecture, self.dtype, self.num_blocks, config.block_size, self.max_model_len)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()

    def step(self) -> list[StepUpdate]:
        """One scheduling step and forward pass; the sequences that got a token or prompt logprobs."""
        out = self.scheduler.schedule()
        if out.empty:
            return []
        result = self.runner.execute(out)
        self.scheduler.update_from_output(out, result.token_ids)
        updates = [StepUpdate(item.request, token_id, logprobs, prompt_logprobs)
                   for item, token_id, logprobs, prompt_logprobs in zip(
                       out.scheduled, result.token_ids, result.logprobs, result.prompt_logprobs)
                   if token_id is not None or prompt_logprobs is not None]
        self.last_stats = StepStats(out.num_batched_tokens, self.scheduler.num_running, self.scheduler.num_waiting,
                                    out.num_preempted, self.kv_cache.usage(),
                                    sum(r.num_computed_tokens for r in self.scheduler.running))
        if self.config.debug_checks:
            self.scheduler.check_invariants()
        return updates


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if model_config.sliding_window:
        # Attention here is full-context; beyond the window the model would differ from its reference.
        limit = min(limit, model_config.sliding_window)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens")
    return config.max_model_len
