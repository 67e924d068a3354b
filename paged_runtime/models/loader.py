"""From a path (or nothing) to a model with its weights and a tokenizer.

``model`` may be a Hugging Face folder (config.json + *.safetensors +
tokenizer files), a ``.gguf`` file (converted once into a cached folder), or
None for the embedded default, SmolLM2-135M-Instruct.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from paged_runtime.models.config import ModelConfig
from paged_runtime.models.gemma3 import Gemma3ForCausalLM
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.models.mixtral import MixtralForCausalLM
from paged_runtime.models.olmoe import OlmoeForCausalLM
from paged_runtime.models.phi3 import Phi3ForCausalLM
from paged_runtime.models.qwen3 import Qwen3ForCausalLM
from paged_runtime.models.qwen3_moe import Qwen3MoeForCausalLM
from paged_runtime.layers.linear import SINGLE, TensorParallel
from paged_runtime.layers.moe import FusedMoE
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.pipeline import WHOLE, PipelineStage
from paged_runtime.layers.quantization import checkpoint_quantization, is_quantized, linear_method
from paged_runtime.utils.cpu import move_to_huge_pages

logger = logging.getLogger(__name__)

# config.json "architectures" -> the model that computes it (config.SUPPORTED_ARCHITECTURES lists the same names)
MODEL_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM,
                 "Qwen2ForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
                 "Gemma3ForCausalLM": Gemma3ForCausalLM,
                 "MixtralForCausalLM": MixtralForCausalLM, "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
                 "OlmoeForCausalLM": OlmoeForCausalLM,
                 "Phi3ForCausalLM": Phi3ForCausalLM}
# Families whose pre-quantized checkpoints are refused, and why: experts load through FusedMoE, which has no
# quantized method; Phi-3 splits its fused checkpoint tensors by rows, which packed layouts do not have.
NOT_PREQUANTIZED = {"MixtralForCausalLM": "mixture of experts", "Qwen3MoeForCausalLM": "mixture of experts",
                    "OlmoeForCausalLM": "mixture of experts",
                    "Phi3ForCausalLM": "its q/k/v and gate/up come fused in the checkpoint"}


def resolve_model_path(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """A folder of weights for ``model``; a GGUF (or the embedded default) is converted once into ``cache_dir``
    (default: ``default_model.cache_dir()``)."""
    if model is None:
        from paged_runtime.models.default_model import default_model_path
        return default_model_path(Path(cache_dir) if cache_dir else None)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist (weights are never downloaded)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file; pass a folder or a .gguf")
        return _converted_gguf(path, cache_dir)
    return path


def _converted_gguf(path: Path, cache: str | Path | None) -> Path:
    from paged_runtime.models.default_model import cache_dir
    from paged_runtime.models.gguf_convert import CONVERTER_VERSION, convert_gguf
    stat = path.stat()
    fingerprint = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERTER_VERSION}"
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
    out = Path(cache or cache_dir()) / f"{path.stem}-{key}"
    return out if (out / "config.json").exists() else convert_gguf(path, out)


def load_model(folder: Path, max_len: int, dtype: torch.dtype, device: torch.device,
               ops: TorchOps | None = None, tp: TensorParallel = SINGLE,
               stage: PipelineStage = WHOLE, quantization: str | None = None) -> LlamaForCausalLM:
    """The model in ``folder`` with its weights; ``ops`` picks its arithmetic (default: plain PyTorch); ``tp``
    and ``stage`` the tensor-parallel shard and pipeline stage this rank holds (default: all of it);
    ``quantization`` ("int8", "int4", "fp8"; None or "none": as the checkpoint) quantizes the decoder layers'
    linear weights once loaded; a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors) is served in its own
    format."""
    config = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    ops = ops or TorchOps()
    quantization = _checkpoint_or_asked(config, quantization)
    method = linear_method(quantization, ops, config.raw.get("quantization_config"))
    model = MODEL_CLASSES[config.architecture](config, max_len, dtype, device, ops, tp, stage, method=method)
    quantized = is_quantized(quantization)
    if quantized and any(isinstance(m, FusedMoE) for m in model.modules()):
        logger.info("--quantization %s: the MoE experts stay unquantized (%s)", quantization, config.architecture)
    # One huge-page buffer holds every parameter: a quantized model frees its full-precision weights after
    # loading, which that shared buffer would keep resident.
    if device.type == "cpu" and not quantized:
        move_to_huge_pages(model)
    loaded = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    filled = model.load_weight(name, f.get_tensor(name))  # one name, or a list (stacked experts)
                    loaded.update(filled if isinstance(filled, list) else [filled])
        except SafetensorError as e:
            raise ValueError(f"corrupt safetensors file {file}: {e}") from e
    missing = model.expected_weights() - loaded
    if missing:
        raise ValueError(f"{folder} lacks weights for {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
    model.process_weights_after_loading()
    if quantized and device.type == "cuda":
        torch.cuda.empty_cache()  # the freed full-precision weights: the KV budget measures free device memory
    return model.eval()


def _checkpoint_or_asked(config: ModelConfig, asked: str | None) -> str | None:
    """The quantization to serve: a pre-quantized checkpoint's own format (asking for another is an error),
    else what was asked."""
    own = checkpoint_quantization(config.raw)
    if own is None:
        return asked
    if asked is not None and asked != own:
        raise ValueError(f"the checkpoint is quantized as {own!r} (config.json quantization_config) but "
                         f"quantization {asked!r} was asked; leave it unset or ask for {own!r}")
    if config.architecture in NOT_PREQUANTIZED:
        raise ValueError(f"pre-quantized {own} checkpoints of {config.architecture} are not supported "
                         f"({NOT_PREQUANTIZED[config.architecture]}); supported: "
                         + ", ".join(sorted(set(MODEL_CLASSES) - set(NOT_PREQUANTIZED))))
    return own


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {folder}: {e}") from e
