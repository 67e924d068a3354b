"""Engine statistics: per-iteration records, Prometheus metrics under vLLM's names, a periodic log line.

The step-loop thread builds one ``IterationStats`` per pass (gauges as they
stand after the pass, counters as deltas) and hands it to every stat logger.
Loggers must be cheap and must not raise into the step loop.

Prometheus families are created once per ``CollectorRegistry`` and shared by
every engine that uses that registry (tests build several engines in one
process; registering a name twice would raise). Each engine writes only its
own ``model_name`` label set, and removes it on ``close()``.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger("paged_runtime.metrics")

# vLLM's bucket boundaries, so existing dashboards' quantile panels line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished request. The phase times are vLLM's: prefill from its first scheduled step to its first
    token, decode from there to its last token, inference the two together; None where the request never
    reached that point (an abort while waiting)."""
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None


# vLLM's cache_config_info labels that schedulers read (llm-d reads block_size and num_gpu_blocks).
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "num_gpu_blocks", "num_cpu_blocks", "prefix_caching_hash_algo")


@dataclass(frozen=True)
class LoRAStats:
    """The adapters of the requests running and waiting now, by name (vLLM's ``vllm:lora_requests_info``)."""
    max_lora: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


@dataclass(slots=True)
class IterationStats:
    """One pass of the step loop: where the engine stands afterwards, and what happened during it."""
    now: float  # time.monotonic()
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks held by requests
    num_preemptions: int = 0
    num_prefix_queries: int = 0  # tokens looked up in the prefix cache
    num_prefix_hits: int = 0  # tokens found there
    num_prompt_tokens: int = 0  # prompts of requests that got their first token in this pass
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # Speculative decoding in this pass: verifications, drafts, accepted drafts (total and per position).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    lora: LoRAStats | None = None  # None: LoRA is off


class StatLogger(Protocol):
    def record_cache_config(self, info: dict[str, str]) -> None:
        """Once the engine is built: its KV cache as ``CACHE_CONFIG_LABELS`` -> text."""

    def record(self, stats: IterationStats) -> None: ...

    def close(self) -> None: ...


@dataclass
class _Families:
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    preemptions: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    request_success: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    inference_time: Histogram
    cache_config: Gauge
    lora_info: Gauge
    prompt_len: Histogram
    generation_len: Histogram
    spec_drafts: Counter
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter
    spec_accepted_per_pos: Counter
    kv_events_dropped: Counter  # the KV-event publisher's (engine/kv_event_publisher.py)


# The one piece of module state: metric families per registry (weak, so a test's registry can go away).
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_FAMILIES_LOCK = threading.Lock()


def families(registry: CollectorRegistry | None = None) -> _Families:
    """The metric families of ``registry`` (default: the process's REGISTRY), created on first use."""
    registry = registry if registry is not None else REGISTRY
    with _FAMILIES_LOCK:
        found = _FAMILIES.get(registry)
        if found is None:
            found = _FAMILIES[registry] = _create_families(registry)
        return found


def _create_families(registry: CollectorRegistry) -> _Families:
    label = ["model_name"]
    kw = {"labelnames": label, "registry": registry}
    length_buckets = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
    return _Families(
        running=Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", **kw),
        waiting=Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", **kw),
        kv_usage=Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", **kw),
        prefix_queries=Counter("vllm:prefix_cache_queries",
                               "Prefix cache queries, in terms of number of queried tokens.", **kw),
        prefix_hits=Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", **kw),
        preemptions=Counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", **kw),
        prompt_tokens=Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", **kw),
        generation_tokens=Counter("vllm:generation_tokens", "Number of generation tokens processed.", **kw),
        request_success=Counter("vllm:request_success", "Count of successfully processed requests.",
                                labelnames=label + ["finished_reason"], registry=registry),
        ttft=Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                       buckets=TTFT_BUCKETS, **kw),
        itl=Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                      buckets=ITL_BUCKETS, **kw),
        e2e=Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                      buckets=REQUEST_LATENCY_BUCKETS, **kw),
        queue_time=Histogram("vllm:request_queue_time_seconds",
                             "Histogram of time spent in WAITING phase for request.",
                             buckets=REQUEST_LATENCY_BUCKETS, **kw),
        prefill_time=Histogram("vllm:request_prefill_time_seconds",
                               "Histogram of time spent in PREFILL phase for request.",
                               buckets=REQUEST_LATENCY_BUCKETS, **kw),
        decode_time=Histogram("vllm:request_decode_time_seconds",
                              "Histogram of time spent in DECODE phase for request.",
                              buckets=REQUEST_LATENCY_BUCKETS, **kw),
        inference_time=Histogram("vllm:request_inference_time_seconds",
                                 "Histogram of time spent in RUNNING phase for request.",
                                 buckets=REQUEST_LATENCY_BUCKETS, **kw),
        cache_config=Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                           labelnames=label + list(CACHE_CONFIG_LABELS), registry=registry),
        prompt_len=Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                             buckets=length_buckets, **kw),
        generation_len=Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                 buckets=length_buckets, **kw),
        spec_drafts=Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", **kw),
        spec_draft_tokens=Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", **kw),
        spec_accepted_tokens=Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", **kw),
        spec_accepted_per_pos=Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labelnames=label + ["position"],
                                      registry=registry),
        lora_info=Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                        labelnames=["max_lora", "waiting_lora_adapters", "running_lora_adapters"] + label,
                        registry=registry),
        kv_events_dropped=Counter("vllm:kv_events_dropped_batches",
                                  "KV-cache event batches dropped: the publisher's queue was full.", **kw),
    )


class PrometheusStatLogger:
    """Writes one engine's stats into ``registry`` (default: the process-wide REGISTRY) under ``model_name``."""

    FINISH_REASONS = ("stop", "length", "abort")

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.families = families(registry)
        f, name = self.families, model_name
        # Bind label sets up front so every series shows (at 0) before the first request.
        self.running, self.waiting, self.kv_usage = (g.labels(name) for g in (f.running, f.waiting, f.kv_usage))
        self.prefix_queries, self.prefix_hits, self.preemptions, self.prompt_tokens, self.generation_tokens = (
            c.labels(name) for c in (f.prefix_queries, f.prefix_hits, f.preemptions, f.prompt_tokens,
                                     f.generation_tokens))
        self.success = {reason: f.request_success.labels(name, reason) for reason in self.FINISH_REASONS}
        self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_len, self.generation_len = (
            h.labels(name) for h in (f.ttft, f.itl, f.e2e, f.queue_time, f.prompt_len, f.generation_len))
        self.phase_times = [h.labels(name) for h in (f.prefill_time, f.decode_time, f.inference_time)]
        self.cache_config_labels: tuple[str, ...] | None = None
        self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens = (
            c.labels(name) for c in (f.spec_drafts, f.spec_draft_tokens, f.spec_accepted_tokens))
        self.spec_positions: list[str] = []  # position labels bound so far
        self.lora_labels: tuple[str, ...] | None = None  # the lora_requests_info series shown now

    def record_cache_config(self, info: dict[str, str]) -> None:
        labels = (self.model_name, *(str(info.get(key, "None")) for key in CACHE_CONFIG_LABELS))
        self.families.cache_config.labels(*labels).set(1)
        self.cache_config_labels = labels

    def record(self, stats: IterationStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for counter, value in ((self.prefix_queries, stats.num_prefix_queries), (self.prefix_hits, stats.num_prefix_hits),
                               (self.preemptions, stats.num_preemptions), (self.prompt_tokens, stats.num_prompt_tokens),
                               (self.generation_tokens, stats.num_generation_tokens),
                               (self.spec_drafts, stats.num_spec_drafts),
                               (self.spec_draft_tokens, stats.num_spec_draft_tokens),
                               (self.spec_accepted_tokens, stats.num_spec_accepted_tokens)):
            if value:
                counter.inc(value)
        if stats.lora is not None:
            self._record_lora(stats.lora)
        for position, accepted in enumerate(stats.spec_accepted_per_position):
            series = self.families.spec_accepted_per_pos.labels(self.model_name, str(position))
            if str(position) not in self.spec_positions:
                self.spec_positions.append(str(position))
            if accepted:
                series.inc(accepted)
        for histogram, values in ((self.ttft, stats.time_to_first_tokens), (self.itl, stats.inter_token_latencies),
                                  (self.queue_time, stats.queue_times)):
            for value in values:
                histogram.observe(value)
        for done in stats.finished:
            success = self.success.get(done.finish_reason)
            if success is None:
                success = self.success[done.finish_reason] = self.families.request_success.labels(
                    self.model_name, done.finish_reason)
            success.inc()
            self.e2e.observe(done.e2e_latency)
            self.prompt_len.observe(done.num_prompt_tokens)
            self.generation_len.observe(done.num_generation_tokens)
            for histogram, value in zip(self.phase_times, (done.prefill_time, done.decode_time, done.inference_time)):
                if value is not None:
                    histogram.observe(value)

    def _record_lora(self, lora: LoRAStats) -> None:
        """vLLM's info gauge: the adapters as comma-separated names in its labels, its value the time of the
        update. One series at a time: the previous label set goes when the adapters change."""
        labels = (str(lora.max_lora), ",".join(lora.waiting), ",".join(lora.running), self.model_name)
        if labels != self.lora_labels:
            if self.lora_labels is not None:
                _remove(self.families.lora_info, *self.lora_labels)
            self.lora_labels = labels
        self.families.lora_info.labels(*labels).set_to_current_time()

    def close(self) -> None:
        """Drop this engine's series from the shared families (another engine may reuse the name later)."""
        f = self.families
        for family in (f.running, f.waiting, f.kv_usage, f.prefix_queries, f.prefix_hits, f.preemptions,
                       f.prompt_tokens, f.generation_tokens, f.ttft, f.itl, f.e2e, f.queue_time, f.prompt_len,
                       f.generation_len, f.spec_drafts, f.spec_draft_tokens, f.spec_accepted_tokens, f.prefill_time,
                       f.decode_time, f.inference_time):
            _remove(family, self.model_name)
        if self.cache_config_labels is not None:
            _remove(f.cache_config, *self.cache_config_labels)
        if self.lora_labels is not None:
            _remove(f.lora_info, *self.lora_labels)
        for position in self.spec_positions:
            _remove(f.spec_accepted_per_pos, self.model_name, position)
        for reason in self.success:
            _remove(f.request_success, self.model_name, reason)


def _remove(family, *labels: str) -> None:
    try:
        family.remove(*labels)
    except KeyError:
        pass


class LoggingStatLogger:
    """Logs at most one line per ``interval`` seconds, only for intervals in which the engine worked.

    The engine makes one idle pass an interval after work stops, so the last
    line shows the idle state.
    """

    def __init__(self, interval: float = 10.0, log: logging.Logger = logger) -> None:
        self.interval = interval
        self.log = log
        self.last_time = time.monotonic()
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_prefix_queries = self.num_prefix_hits = 0
        self.active = False  # anything happened since the last line

    def record_cache_config(self, info: dict[str, str]) -> None:
        self.log.info("KV cache: %s blocks of %s tokens (%s)", info.get("num_gpu_blocks"), info.get("block_size"),
                      info.get("cache_dtype"))

    def record(self, stats: IterationStats) -> None:
        busy = bool(stats.num_running or stats.num_waiting or stats.num_generation_tokens)
        if busy and not self.active:
            self.last_time = stats.now  # a burst after idle: its rate is over the burst, not the idle time
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_generation_tokens += stats.num_generation_tokens
        self.num_prefix_queries += stats.num_prefix_queries
        self.num_prefix_hits += stats.num_prefix_hits
        self.active = self.active or busy
        if self.active and stats.now - self.last_time >= self.interval:
            self._log(stats)

    def _log(self, stats: IterationStats) -> None:
        elapsed = max(stats.now - self.last_time, 1e-9)
        hit_rate = self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0
        self.log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                      "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                      self.num_prompt_tokens / elapsed, self.num_generation_tokens / elapsed, stats.num_running,
                      stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hit_rate)
        self.last_time = stats.now
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_prefix_queries = self.num_prefix_hits = 0
        self.active = bool(stats.num_running or stats.num_waiting)

    def close(self) -> None:
        pass
