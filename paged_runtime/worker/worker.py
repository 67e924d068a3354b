"""One device's share of the model: its weights (a tensor-parallel shard of one pipeline stage), its paged
KV cache and its model runner. The engine drives one worker per device through an executor
(``paged_runtime/executor``); with a single device the worker lives in the engine's own process.

Start-up is two calls because every rank must hold the same number of blocks (block tables are the same on
every rank): ``load`` builds the model and says how many blocks fit beside it, and the executor passes the
smallest answer to every rank's ``init_cache``.

Ranks: global rank ``pp_rank * tp_size + tp_rank``. The tensor-parallel ranks of a stage form one group
(its all-reduces and the LM head's gather); stage s sends to the same tensor-parallel rank of stage s + 1.
The driver rank, tensor-parallel rank 0 of the last stage, is the only one that samples: the others compute
their share of the forward pass and learn the sampled tokens from the scheduler's next step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_runtime.attention import select_backend, uses_triton
from paged_runtime.config import EngineConfig
from paged_runtime.kernels import cpu as cpu_kernels, kv_quant
from paged_runtime.layers.linear import SINGLE, TensorParallel
from paged_runtime.layers.ops import CpuKernelOps, select_ops
from paged_runtime.layers.pipeline import WHOLE, PipelineStage
from paged_runtime.models import registry
from paged_runtime.models.loader import GGUF_TYPES, load_model
from paged_runtime.lora.slots import LoRASlots
from paged_runtime.spec_decode.draft_model import DraftModelProposer
from paged_runtime.worker.kv_budget import bytes_per_block, free_memory, num_kv_blocks
from paged_runtime.utils.devices import resolve_device
from paged_runtime.worker.model_runner import ModelRunner, allocate_kv_caches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds its share from (plain data: it is sent to worker processes)."""
    config: EngineConfig
    model_path: Path
    dtype: torch.dtype
    max_model_len: int
    draft_path: Path | None = None  # speculative decoding's draft model (one device only)
    blocks_per_request: int | None = None  # the most blocks one request holds (None: max_model_len's)
    lookahead: int = 0  # speculative slots past a request's last token
    kv_cache_dtype: str = "auto"  # the cache's, resolved (utils.devices.resolve_precision); "auto": dtype


@dataclass(frozen=True)
class Placement:
    """Where a worker sits among ``tp_size * pp_size`` ranks, and how they meet (``init_method``: a
    torch.distributed rendezvous address; None for one rank)."""
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    init_method: str | None = None
    local_rank: int = 0  # which device of its node (CUDA)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_driver(self) -> bool:
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1


def driver_rank(tp_size: int, pp_size: int) -> int:
    """The rank that samples: tensor-parallel rank 0 of the last pipeline stage."""
    return (pp_size - 1) * tp_size


@dataclass(frozen=True)
class WorkerInfo:
    num_blocks: int  # KV blocks that fit on this rank
    rope_switch: int | None  # the model's LongRoPE switch (the scheduler's)
    ops_name: str
    attention_backend: str
    cpu_kernels: dict | None = None  # kernels/cpu.info() where this rank runs the compiled CPU kernels, else None


class Worker:
    def __init__(self, spec: WorkerSpec, placement: Placement = Placement()) -> None:
        self.spec, self.placement = spec, placement
        config = spec.config
        self.device = _device(config, placement)
        tp, stage = init_parallel(placement, self.device)
        self.ops = select_ops(self.device, spec.dtype, False if config.enforce_eager else config.cpu_kernels,
                              config.cache_dir,
                              triton=not config.enforce_eager and uses_triton(self.device, config.attention_backend),
                              isa_name=config.cpu_isa)
        self.runs_cpu_kernels = isinstance(self.ops, CpuKernelOps)  # or below: GGUF blocks, an 8-bit cache
        self.model = load_model(spec.model_path, spec.max_model_len, spec.dtype, self.device, self.ops, tp, stage,
                                config.quantization, self._gguf_kernels(spec.model_path))
        self.draft = None if spec.draft_path is None else load_model(spec.draft_path, spec.max_model_len, spec.dtype,
                                                                     self.device, self.ops)
        self.lora = None if config.lora_config is None else LoRASlots(self.model, config.lora_config, self.ops,
                                                                        spec.dtype, self.device)
        self.attention_backend = select_backend(self.device, isinstance(self.ops, CpuKernelOps),
                                                config.attention_backend,
                                                registry.family(self.model.config.architecture).encoder_only)
        self._check_cache_dtype()
        if spec.kv_cache_dtype != "auto" and self.device.type == "cpu" and not config.enforce_eager:
            # The torch backend reads an 8-bit cache through the compiled one-pass gather where it builds
            # (whatever the op set); else in PyTorch, 2-4x slower per step at long contexts (measured).
            self._load_cpu_kernels()
        self.runner: ModelRunner | None = None

    def _load_cpu_kernels(self) -> bool:
        """Load the compiled CPU kernels for the config's ``cpu_isa`` (ValueError for one this CPU lacks or
        another than the process loaded); whether they did (this rank then reports them in its WorkerInfo)."""
        config = self.spec.config
        loaded = cpu_kernels.load(config.cache_dir, config.cpu_isa)
        self.runs_cpu_kernels |= loaded
        return loaded

    def _check_cache_dtype(self) -> None:
        """ValueError at start-up for a cache the attention backend cannot read: Triton reads the model's dtype
        or 8 bits, not a bfloat16 cache under wider activations (its CPU interpreter, where its kernels are
        tested without a GPU, has no bfloat16 to test that read with)."""
        dtype, name = self.spec.dtype, self.spec.kv_cache_dtype
        if self.attention_backend == "triton" and kv_quant.cache_dtype(name, dtype) == torch.bfloat16 != dtype:
            raise ValueError(f"--kv-cache-dtype {name} under {dtype} activations is not supported by the triton "
                             "attention backend: give --kv-cache-dtype fp8, int8, or auto with an explicit --dtype "
                             "(the cache in that dtype), or another --attention-backend")

    def _gguf_kernels(self, path: Path):
        """The compiled CPU kernels for a GGUF served as blocks (they multiply blocks on any x86 CPU, AVX-512
        or not), unless compiled kernels are switched off; None elsewhere."""
        config = self.spec.config
        if (self.device.type != "cpu" or config.quantization == "none" or not (path / GGUF_TYPES).is_file()
                or config.cpu_kernels is False or config.enforce_eager):
            return None
        if self._load_cpu_kernels():
            return cpu_kernels
        logger.warning("GGUF blocks are multiplied by dequantizing them in PyTorch (the CPU kernels did not load)")
        return None

    def load(self) -> WorkerInfo:
        """How many KV blocks fit on this rank beside its weights, and what the engine needs of the model."""
        c = self.spec.config
        budget = c.kv_cache_memory or free_memory(self.device, c.gpu_memory_utilization, self.placement.world_size)
        models = [self.model] + ([self.draft] if self.draft is not None else [])
        per_block = bytes_per_block(models, c.block_size, self.spec.dtype, self.spec.kv_cache_dtype)
        num_blocks = num_kv_blocks(per_block, c.block_size, budget,
                                   self.spec.max_model_len, c.max_num_seqs, self.spec.blocks_per_request)
        return WorkerInfo(num_blocks, self.model.rope_switch, self.ops.name, self.attention_backend,
                          cpu_kernels.info() if self.runs_cpu_kernels else None)

    def init_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks and build the runner."""
        spec, c = self.spec, self.spec.config
        num_slots = num_blocks * c.block_size
        drafter = None if self.draft is None else DraftModelProposer(
            self.draft, allocate_kv_caches(self.draft, num_slots, spec.dtype, self.device, spec.kv_cache_dtype))
        # CUDA graphs capture one device's step; a parallel step's collectives are not captured.
        one_device = self.placement.world_size == 1
        graphs = (c.max_num_seqs, spec.max_model_len) if (
            one_device and not c.enforce_eager and self.device.type == "cuda") else None
        max_blocks = -(-(spec.max_model_len + spec.lookahead) // c.block_size)
        self.runner = ModelRunner(self.model, num_blocks, c.block_size, self.device, spec.dtype, c.seed,
                                  self.attention_backend, max_blocks, drafter, graphs,
                                  samples=self.placement.is_driver, kv_cache_dtype=spec.kv_cache_dtype,
                                  lora=self.lora)

    def execute(self, out):
        return self.runner.execute(out)

    def retain(self, request_ids) -> None:
        self.runner.retain(request_ids)

    def check_invariants(self, request_ids) -> None:
        self.runner.check_invariants(request_ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a sticky device error surfaces here

    def add_lora(self, request) -> None:
        """Read and check an adapter into host memory (``LoRAError`` says why it cannot run)."""
        self.lora.add(request)

    def remove_lora(self, lora_id: int) -> None:
        self.lora.remove(lora_id)

    def use_grammars(self, grammars) -> None:
        """Structured-output constraints compile with ``grammars`` (the sampling rank's concern)."""
        self.runner.states.grammars = grammars

    def close(self) -> None:
        if self.placement.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def init_parallel(p: Placement, device: torch.device) -> tuple[TensorParallel, PipelineStage]:
    """Join the ranks' process group (gloo on the CPU, NCCL on CUDA); this rank's shard and stage."""
    if p.world_size == 1:
        return SINGLE, WHOLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=p.init_method, rank=p.rank, world_size=p.world_size)
    # Every rank creates every stage's group, in the same order (torch.distributed requires it).
    groups = [torch.distributed.new_group(list(range(s * p.tp_size, (s + 1) * p.tp_size)))
              for s in range(p.pp_size)]
    tp = TensorParallel(p.tp_rank, p.tp_size, groups[p.pp_rank])
    stage = PipelineStage(p.pp_rank, p.pp_size, p.rank - p.tp_size if p.pp_rank > 0 else None,
                          p.rank + p.tp_size if p.pp_rank < p.pp_size - 1 else None)
    return tp, stage


def _device(config: EngineConfig, p: Placement) -> torch.device:
    device = resolve_device(config.device)
    if device.type == "cuda" and p.world_size > 1:
        device = torch.device("cuda", p.local_rank)
        torch.cuda.set_device(device)
    return device
