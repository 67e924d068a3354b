"""Every setting, declared once (``settings.setting``): the engine's (``EngineConfig``) and the HTTP front's
(``ServerConfig``), with vLLM's names.

``paged-runtime serve``'s flags, the KServe adapter's, Ray Serve's ``AppArgs`` and ``LLM(...)``'s keywords
are all generated from these fields (``paged_runtime/settings.py``): a new setting is one field here. Values
are checked once, when a config is built. This module imports no torch (the Ray ingress and ``--help`` read it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_runtime.settings import (CollectPaths, ExtendOrigins, check_settings, from_source, parse_bytes,
                                    parse_switch, parse_words, read_chat_template, setting)
from paged_runtime.core.kv_events import KVEventsConfig
from paged_runtime.lora.request import LoRAConfig, parse_lora_module_list, parse_lora_modules
from paged_runtime.spec_decode.config import SpeculativeConfig
from paged_runtime.pooling_params import POOLING_TYPES, RUNNERS, parse_runner

CACHE_ENV = "PAGED_RUNTIME_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/paged_runtime"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default (models/default_model.py serves it)
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
# --quantization: weights quantized at load, or a checkpoint's own format (layers/quantization maps each name)
QUANTIZATIONS = ("none", "int8", "int4", "fp8", "gguf", "gptq", "awq", "compressed-tensors")
# --kv-cache-dtype: the paged cache's elements (kernels/kv_quant.CACHE_DTYPES maps each name)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")  # core/scheduler.py orders by each
ATTENTION_BACKENDS = ("torch", "cpu", "triton")  # attention/__init__.py's BUILDERS
CPU_ISAS = ("auto", "amx", "avx512_vnni", "avx512", "avx_vnni", "avx2", "scalar")  # kernels/cpu.ISAS, best first
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # entrypoints/openai/tool_parsers.TOOL_PARSERS
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # entrypoints/openai/reasoning_parsers.REASONING_PARSERS
LOG_LEVELS = ("debug", "info", "warning", "error")
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor")  # core/block_hash.HASH_FUNCTIONS (vLLM's definitions)
KV_EVENTS_FORMATS = ("array", "map")  # core/kv_events.EVENT_FORMATS: vLLM <= 0.25's event layout, 0.26's
# A 128k-token context is ~0.5 MB as text and ~1 MB as JSON token ids: 16 MiB holds a full-context prompt many
# times over, yet bounds what one request makes the server buffer, parse and tokenize.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
# Each prompt of a completions list is its own engine request: one request may fill a default batch
# (max_num_seqs 256), not the waiting queue by thousands.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
# Stored /v1/responses (store: true, previous_response_id): in memory, least recently used out beyond these.
DEFAULT_RESPONSES_STORE_MAX_ENTRIES = 1024
DEFAULT_RESPONSES_STORE_MAX_BYTES = 64 * 2**20


def default_cache_dir() -> Path:
    """``$PAGED_RUNTIME_CACHE`` or ``~/.cache/paged_runtime``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def served_model_names(served_model_name: str | list[str] | None, model: str | None) -> list[str]:
    """The names clients use: the configured ones, else the model path as given, else the default's."""
    if isinstance(served_model_name, str):
        return [served_model_name]
    return list(served_model_name) if served_model_name else [model or DEFAULT_MODEL_NAME]


@dataclass
class EngineConfig:
    """What the engine runs and how (``LLM(...)`` keywords; flags and Ray arguments of the same names)."""
    model: str | None = setting(None, "Hugging Face folder or .gguf file; None: the embedded SmolLM2-135M-Instruct "
                                "(serve: repeat it to serve several models)", metavar="MODEL", action=CollectPaths)
    tokenizer: str | None = setting(None, "tokenizer folder; None: the model's")
    served_model_name: list[str] | None = setting(
        None, "name(s) clients use for the model; the first one labels the metrics; None: the model path",
        group="server")
    dtype: str = setting("auto", "activations' dtype: auto takes the checkpoint's (bfloat16 for float16 on the CPU; "
                         "float32 for a GGUF served as its blocks on the CPU)", choices=DTYPES)
    quantization: str | None = setting(
        None, "quantize the weights at load: int8 (W8A16, per output channel), int4 (W4A16, groups of 128, "
        "asymmetric) or fp8 (W8A8 float8_e4m3fn, per channel, activations per token, through torch._scaled_mm). "
        "Quantized checkpoints are served in their own format, detected: a .gguf's blocks (gguf), or config.json's "
        "gptq, awq, compressed-tensors (W8A16, W4A16, FP8); naming another format is an error; none dequantizes "
        "a .gguf", choices=QUANTIZATIONS, aliases=("-q",))
    kv_cache_dtype: str = setting(
        "auto", "the paged KV cache's elements: auto (the model's dtype), bfloat16 (under float32 activations: half "
        "the bytes), fp8 / fp8_e4m3 (float8_e4m3fn, per-tensor scales 1.0), int8 (per token and head scales): ~2x "
        "the tokens per byte", choices=KV_CACHE_DTYPES)
    max_model_len: int | None = setting(None, "longest prompt + output in tokens; None: the model's own",
                                        ge=2, hf_aliases=("--max_model_len", "--max_length"))
    max_num_seqs: int = setting(256, "most requests in one step", ge=1)
    max_num_batched_tokens: int | None = setting(None, "most tokens in one step; None: 2048 on the CPU, "
                                                       "max(2048, min(max_model_len, 8192)) on a GPU (an "
                                                       "encoder-only model's: at least max_model_len)", ge=1)
    long_prefill_token_threshold: int = setting(
        0, "with chunked prefill, most tokens one request computes in a step while others run or wait (a long "
        "prompt's chunks then take a bounded share of the steps decoding streams wait for; at most "
        "max_model_len); 0: no cap", ge=0)
    block_size: int = setting(16, "tokens per KV-cache block", ge=1)
    kv_cache_memory: int | None = setting(None, "bytes for the KV cache (e.g. 2GiB); None: a share of free memory",
                                          gt=0, parse=parse_bytes, aliases=("--kv-cache-memory-bytes",))
    gpu_memory_utilization: float = setting(0.9, "share of the GPU's memory for weights and KV cache", gt=0, le=1)
    seed: int = setting(0, "the sampling seed of requests without their own")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of earlier requests' common prefixes")
    prefix_caching_hash_algo: str = setting(
        "sha256", "the prefix cache's block hash, as vLLM defines it: sha256 (of the pickled block, Python's own) or "
        "sha256_cbor (of its canonical CBOR: reproducible in any language; set PYTHONHASHSEED, which seeds the "
        "first block, alike wherever hashes are compared)", choices=PREFIX_CACHING_HASH_ALGOS)
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = setting(
        None, 'KV-cache events over ZMQ as JSON with vLLM\'s keys, e.g. \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\' '
        "(also buffer_steps, hwm, max_queue_size); a wildcard, ipc or inproc endpoint is bound, any other "
        "connected to. Events carry every prompt's token ids: publish only where trusted consumers listen")
    kv_events_format: str = setting(
        "array", "how KV-cache events are laid out: array (vLLM up to 0.25: tagged positional arrays) or map "
        "(vLLM 0.26 on: tagged maps, and replay replies carry the topic)", choices=KV_EVENTS_FORMATS)
    scheduling_policy: str = setting("fcfs", "fcfs, or priority: lower value first, then arrival",
                                     choices=SCHEDULING_POLICIES)
    enforce_eager: bool = setting(False, "plain PyTorch: no CUDA graphs on a GPU, no compiled decode kernels on "
                                         "the CPU")
    debug_checks: bool = setting(False, "check the block-accounting invariants after every step (slow; tests)")
    async_scheduling: bool | None = setting(
        None, "schedule step N+1 while step N runs; None: on for CUDA without speculative decoding, off on the CPU "
        "(measured: benchmarks/async_scheduling.py)")
    max_stop_strings: int = setting(64, "most stop strings one request may send (each is matched after every "
                                        "token; OpenAI allows 4)", ge=1, group="server")
    max_stop_string_length: int = setting(512, "longest stop string a request may send, in characters", ge=1,
                                          group="server")
    max_logprobs: int = setting(20, "most logprobs / top_logprobs / prompt_logprobs a request may ask for", ge=0,
                                group="server")
    generation_config: str = setting(
        "auto", "default sampling parameters: 'auto' from the model's generation_config.json, 'vllm' the "
        "runtime's own, or a folder holding a generation_config.json", metavar="auto|vllm|FOLDER", group="server")
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = setting(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'')
    runner: str = setting(
        "auto", "what the model is run as: generate (text generation) or pooling (an embedder: POST /v1/embeddings, "
        "LLM.embed; prefill only, no sampling); auto is pooling for an encoder-only model (BertModel, which cannot "
        "generate), else generate; vLLM's older task name embed reads as pooling (LLM(task='embed') too)",
        choices=RUNNERS, parse=parse_runner)
    pooling_type: str | None = setting(
        None, "pooling of a --runner pooling model: LAST (the last prompt token's final hidden state), MEAN (the "
        "mean over the prompt's) or CLS (the first token's); None: the folder's sentence-transformers config "
        "(modules.json + 1_Pooling/config.json), else the family's (CLS for BERT, LAST otherwise)",
        choices=POOLING_TYPES)
    normalize: bool = setting(True, "--runner pooling: L2-normalise embeddings (vLLM's embed pooler)")
    cache_dir: str = setting(DEFAULT_CACHE_DIR, "converted models and compiled kernels", env=(CACHE_ENV,))
    cpu_kernels: bool | None = setting(
        None, "the compiled CPU kernels: None picks them where the CPU has their vector paths (AVX-512, or AVX2 + "
        "FMA + F16C); True / False force them on / off", env=("PAGED_RUNTIME_CPU_KERNELS",), parse=parse_switch)
    cpu_isa: str = setting(
        "auto", "the instruction set the compiled CPU kernels are built for: auto (-march=native: all this CPU has), "
        "or less, to rule a path out: amx (x86-64-v4 + AVX512-VNNI, AVX512-BF16, AMX-INT8), avx512_vnni "
        "(x86-64-v4 + AVX512-VNNI), avx512 (x86-64-v4), avx_vnni (x86-64-v3 + AVX-VNNI), avx2 (x86-64-v3), scalar "
        "(plain loops); one per process; a set this CPU lacks is refused when they load",
        choices=CPU_ISAS, env=("PAGED_RUNTIME_CPU_ISA",))
    attention_backend: str | None = setting(None, "torch, cpu or triton instead of the automatic choice",
                                            choices=ATTENTION_BACKENDS,
                                            env=("PAGED_RUNTIME_ATTENTION_BACKEND",))
    tensor_parallel_size: int = setting(1, "split each layer over this many devices (one worker process each)",
                                        ge=1, aliases=("-tp",), hf_aliases=("--tensor_parallel_size",),
                                        group="parallelism")
    pipeline_parallel_size: int = setting(1, "split the layers into this many stages (one worker process per "
                                             "device each)", ge=1, aliases=("-pp",), group="parallelism")
    distributed_executor_backend: str | None = setting(
        None, "how the workers run: local processes (mp, the default on one machine) or Ray actors (ray: any node; "
        "the default inside a Ray cluster)", choices=("mp", "ray"), group="parallelism")
    enable_lora: bool = setting(False, "serve LoRA adapters over the model (PEFT folders: --lora-modules, "
                                "/v1/load_lora_adapter, LLM's lora_request)", group="lora")
    max_loras: int = setting(1, "most distinct adapters in one step (their slots are kept on the device)", ge=1,
                             group="lora")
    max_lora_rank: int = setting(16, "the largest adapter rank a slot holds (a larger one is refused at load)",
                                 ge=1, group="lora")
    max_cpu_loras: int | None = setting(None, "adapters kept in host memory besides the device's slots, least "
                                        "recently used out; None: max_loras", ge=1, group="lora")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        self.cache_dir = str(Path(self.cache_dir).expanduser())
        self.runner = parse_runner(self.runner) if isinstance(self.runner, str) else self.runner
        check_settings(self)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        self._check_parallel()
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.async_scheduling and self.speculative_config is not None:
            # A verifying step's accepted count decides where the next one starts: nothing can be scheduled
            # behind it, and drafts need the previous token on the host (as vLLM, for its n-gram and draft models).
            raise ValueError("async_scheduling does not combine with speculative decoding: turn one of them off")

    @property
    def is_pooling(self) -> bool:
        """The model runs as a pooler (embeddings), not a generator."""
        return self.runner == "pooling"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The adapter bounds the workers and the scheduler keep, or None: LoRA is off."""
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None

    @property
    def served_model_names(self) -> list[str]:
        return served_model_names(self.served_model_name, self.model)

    def _check_parallel(self) -> None:
        if self.world_size == 1:
            return
        # Only the sampling rank knows a step's tokens until the scheduler's next step tells the others.
        if self.async_scheduling:
            raise ValueError("async_scheduling needs one device: turn it off with tensor or pipeline parallelism")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError("a draft model needs one device: use speculative decoding with method ngram, or "
                             "tensor_parallel_size = pipeline_parallel_size = 1")

    @classmethod
    def from_attributes(cls, source: Any, **overrides: Any) -> EngineConfig:
        """From any object whose attributes carry these names (parsed flags, an adapter's args); names it lacks
        keep their defaults, ``overrides`` win."""
        return from_source(cls, source, **overrides)


@dataclass
class ServerConfig:
    """The HTTP front's settings: the OpenAI routes' edge, auth, backpressure, shutdown and logging, shared by
    ``paged-runtime serve`` and both adapters (``entrypoints/openai/api.build_app`` takes them)."""
    host: str = setting("127.0.0.1", "address to bind", group="server", front_ends=frozenset({"serve"}))
    port: int = setting(8000, "port to listen on", group="server", ge=0, le=65535, front_ends=frozenset({"serve"}))
    api_key: list[str] | None = setting(
        None, "require 'Authorization: Bearer <key>' with one of these keys on every route but /health, /version, "
        "KServe's probes and (unless --metrics-require-api-key) /metrics; with two or more keys, each key's "
        "requests get a prefix cache of their own", group="server", env=("PAGED_RUNTIME_API_KEY", "VLLM_API_KEY"),
        parse=parse_words, secret=True, metavar="KEY")
    api_keys_file: str | None = setting(None, "more API keys, one per line ('#' starts a comment line)",
                                        metavar="FILE", group="server")
    share_prefix_cache_across_keys: bool = setting(
        False, "with several API keys, let their requests share cached prompt blocks (cache hits then show across "
        "keys)", group="server")
    enable_prompt_tokens_details: bool = setting(
        False, "report usage.prompt_tokens_details.cached_tokens (as vLLM; it tells a caller which prompts "
        "others sent, where callers share the cache)", group="server")
    allowed_hosts: list[str] | None = setting(
        None, "Host header names the server answers ('*': any); default: any, except that a server bound to a "
        "loopback address without an API key answers loopback names only (against DNS rebinding)",
        parse=parse_words, metavar="HOST", group="server")
    max_waiting_requests: int | None = setting(
        None, "beyond this many queued requests, answer 503 with Retry-After; None: unbounded", ge=1, group="server")
    engine_step_timeout: float | None = setting(
        300.0, "seconds one engine step may run with work pending before the engine is declared stalled: /health "
        "answers 503 for good and requests in flight fail (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S idea; generous "
        "because a long prefill chunk of a large model on a small CPU takes minutes); None or 0: never", ge=0,
        env=("PAGED_RUNTIME_ENGINE_STEP_TIMEOUT", "VLLM_ENGINE_ITERATION_TIMEOUT_S"), parse=float, group="server")
    shutdown_timeout: float = setting(
        30.0, "on SIGTERM/SIGINT, seconds in-flight requests get to finish (new ones get 503); then the rest end "
        "with an error", ge=0, group="server")
    max_request_body_bytes: int = setting(DEFAULT_MAX_REQUEST_BODY_BYTES, "larger request bodies get 413 (e.g. "
                                          "16MiB)", ge=1, parse=parse_bytes, group="server")
    max_prompts_per_request: int = setting(DEFAULT_MAX_PROMPTS_PER_REQUEST, "most prompts in one /v1/completions "
                                           "'prompt' list (each is one engine request)", ge=1, group="server")
    responses_store_max_entries: int = setting(
        DEFAULT_RESPONSES_STORE_MAX_ENTRIES, "most /v1/responses kept for GET and previous_response_id (in memory, "
        "least recently used out first; 0: none kept)", ge=0, group="server")
    responses_store_max_bytes: int = setting(
        DEFAULT_RESPONSES_STORE_MAX_BYTES, "most bytes of stored /v1/responses (their JSON, conversations included; "
        "e.g. 64MiB)", ge=0, parse=parse_bytes, group="server")
    models_dir: str | None = setting(
        None, "serve every model in this folder (each folder in it holding a config.json, each .gguf file), named "
        "by folder or file stem, beside any --model; requests pick one by 'model'", metavar="DIR", group="models")
    max_loaded_models: int | None = setting(
        None, "with several models, keep at most this many loaded: a model loads on its first request, after "
        "the least recently used idle one is unloaded; each loaded model's KV cache gets --kv-cache-memory, or "
        "this share of the default budget; None: every model, loaded at start", ge=1, group="models",
        front_ends=frozenset({"serve"}))
    allowed_origins: list[str] | None = setting(
        None, "enable CORS for exactly these origins (e.g. https://app.example.com, or vLLM's JSON list "
        "'[\"https://a\"]'); None: no CORS", metavar="ORIGIN", action=ExtendOrigins, group="server")
    chat_template: str | None = setting(None, "a Jinja chat template (a file, or the template itself) instead of "
                                              "the tokenizer's", parse=read_chat_template, metavar="FILE_OR_JINJA",
                                        group="server")
    metrics_require_api_key: bool = setting(False, "with --api-key, /metrics needs the key too (default: open for "
                                                   "scrapers)", group="server")
    enable_auto_tool_choice: bool = setting(False, 'tool_choice "auto": parse tool calls out of the output with '
                                                   "--tool-call-parser", group="server")
    tool_call_parser: str | None = setting(None, "the model's tool-call format (hermes: Hermes / Qwen <tool_call>; "
                                                 "llama3_json; mistral)", choices=TOOL_CALL_PARSERS, group="server")
    reasoning_parser: str | None = setting(None, "split <think>...</think> into reasoning_content; constraints "
                                                 "apply after it", choices=REASONING_PARSERS, group="server")
    disable_log_requests: bool = setting(False, "accepted for vLLM launch lines: requests' contents are never logged",
                                         hf_aliases=("--disable_log_requests",), group="logging")
    disable_log_stats: bool = setting(False, "no periodic throughput log line", group="logging")
    log_stats_interval: float = setting(10.0, "seconds between stats log lines", gt=0, group="logging")
    log_level: str = setting("info", "the runtime's log level", choices=LOG_LEVELS, group="logging")
    lora_modules: list[str] | None = setting(
        None, "adapters served from the start, each name=path or vLLM's JSON {\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...} (needs --enable-lora)", parse=parse_lora_module_list, metavar="NAME=PATH",
        group="lora")
    allow_runtime_lora_updating: bool = setting(
        False, "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter", parse=parse_switch,
        env=("PAGED_RUNTIME_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"), group="lora")
    dynamic_lora_loading_path: str | None = setting(
        None, "a folder of adapter folders: a request whose model names one (or base:name) loads it on first use",
        metavar="DIR", group="lora")
    uvicorn_log_level: str | None = setting(None, "uvicorn's log level (its access log is at info); None: "
                                                  "--log-level", choices=("critical", "error", "warning", "info",
                                                                          "debug", "trace"),
                                            group="logging", front_ends=frozenset({"serve"}))

    def __post_init__(self) -> None:
        check_settings(self)  # (the chat options' combination: entrypoints/openai's ChatOptions, at start-up)
        parse_lora_modules(self.lora_modules or [])  # a malformed entry is an error at start-up

    @classmethod
    def from_attributes(cls, source: Any, **overrides: Any) -> ServerConfig:
        return from_source(cls, source, **overrides)
