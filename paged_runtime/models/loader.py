"""From a path (or nothing) to a model with its weights and a tokenizer.

``model`` may be a Hugging Face folder (config.json + *.safetensors +
tokenizer files), a ``.gguf`` file (converted once into a cached folder), or
None for the embedded default, SmolLM2-135M-Instruct.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from paged_runtime.models import registry
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.layers.linear import SINGLE, TensorParallel
from paged_runtime.layers.moe import FusedMoE
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.pipeline import WHOLE, PipelineStage
from paged_runtime.layers.quantization import CHECKPOINT_FORMATS, checkpoint_quantization, is_quantized, linear_method
from paged_runtime.layers.quantization.gguf_blocks import SERVED
from paged_runtime.utils.cpu import move_to_huge_pages

logger = logging.getLogger(__name__)



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
               stage: PipelineStage = WHOLE, quantization: str | None = None, kernels=None) -> LlamaForCausalLM:
    """The model in ``folder`` with its weights; ``ops`` picks its arithmetic (default: plain PyTorch); ``tp``
    and ``stage`` the tensor-parallel shard and pipeline stage this rank holds (default: all of it);
    ``quantization`` as ``EngineConfig.quantization`` (``resolve_quantization``); ``kernels``: the compiled
    CPU kernels module where it loaded (GGUF blocks are multiplied by it)."""
    config = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    ops = ops or TorchOps()
    quantization = resolve_quantization(quantization, folder, config)
    method = linear_method(quantization, ops, config.raw.get("quantization_config"), kernels)
    model_class = registry.family(config.architecture).model_class
    model = model_class(config, max_len, dtype, device, ops, tp, stage, method=method)
    quantized = is_quantized(quantization)
    if quantized and any(isinstance(m, FusedMoE) for m in model.modules()):
        logger.info("--quantization %s: the MoE experts stay unquantized (%s)", quantization, config.architecture)
    # One huge-page buffer holds every parameter: a quantized model frees its full-precision weights after
    # loading, which that shared buffer would keep resident.
    if device.type == "cpu" and not quantized:
        move_to_huge_pages(model)
    loaded = set()
    # A GGUF's blocks first: the plain copies of the weights the model took as blocks are skipped below.
    served = _load_gguf_blocks(model, folder, loaded) if quantization == "gguf" else set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in served:
                        continue
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


GGUF_TYPES = Path("gguf") / "types.json"  # beside a converted GGUF's weights (models/gguf_convert.py)


def serves_gguf_blocks(folder: Path, quantization: str | None) -> bool:
    """Whether ``folder`` (a converted .gguf) is served as its blocks: unless ``--quantization none``
    dequantizes it (any other contradicting name is refused by ``resolve_quantization``)."""
    return (folder / GGUF_TYPES).is_file() and quantization != "none"


def stored_quantization(folder: Path, config: ModelConfig) -> str | None:
    """The format the checkpoint's weights are stored in: "gguf" for a converted .gguf, a pre-quantized
    checkpoint's quant_method, None for plain weights."""
    return "gguf" if (folder / GGUF_TYPES).is_file() else checkpoint_quantization(config.raw)


def resolve_quantization(asked: str | None, folder: Path, config: ModelConfig) -> str | None:
    """The method to load ``folder`` with: the checkpoint's own format (nothing asked, or the same), plain
    weights for "none" (a .gguf dequantized at load), a quantize-at-load method for a plain checkpoint.
    ValueError where the two contradict."""
    own = stored_quantization(folder, config)
    if own is None:
        if asked == "gguf" or asked in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization {asked!r} is a checkpoint format; {folder} holds plain weights "
                             f"(quantize them at load with int8, int4 or fp8)")
        return asked
    if asked == "none" and own == "gguf":
        logger.info("--quantization none: the GGUF's blocks are dequantized at load")
        return None
    if asked is not None and asked != own:
        dequantize = " or none to dequantize it" if own == "gguf" else ""
        raise ValueError(f"the checkpoint is quantized as {own!r}; quantization {asked!r} contradicts it: leave it "
                         f"unset or ask for {own!r}{dequantize}")
    if own == "gguf":
        _check_gguf_types(folder)
    else:
        _check_prequantized(own, config.architecture)
    return own


def _check_prequantized(quant_method: str, architecture: str) -> None:
    """ValueError where the family refuses pre-quantized checkpoints (saying why and which families load them)."""
    why = registry.family(architecture).not_prequantized
    if why is not None:
        loadable = sorted(f.architecture for f in registry.families() if f.not_prequantized is None)
        raise ValueError(f"pre-quantized {quant_method} checkpoints of {architecture} are not supported ({why}); "
                         f"supported: {', '.join(loadable)}")


def _check_gguf_types(folder: Path) -> None:
    types = json.loads((folder / GGUF_TYPES).read_text())
    unserved = {name: t for name, t in types.items() if t not in SERVED}
    if unserved:
        name, qtype = next(iter(unserved.items()))
        raise ValueError(f"GGUF tensor {name} is stored as {qtype}, which is not served quantized "
                         f"({len(unserved)} such tensors); served types: {', '.join(SERVED)}. Pass --quantization "
                         f"none to dequantize the file at load")


def _load_gguf_blocks(model, folder: Path, loaded: set) -> set[str]:
    """Load the GGUF block tensors the model takes as blocks; the names of their plain copies to skip (a
    module that takes only plain weights, e.g. MoE experts, gets the dequantized copy, with a log line)."""
    served, plain = set(), []
    with safe_open(str(folder / "gguf" / "blocks.safetensors"), framework="pt", device="cpu") as f:
        for name in f.keys():
            filled = model.load_weight(name, f.get_tensor(name))
            stem = name.removesuffix("_type").removesuffix(".qweight")
            if filled is None:
                plain.append(stem)
                continue
            loaded.add(filled)
            served.add(f"{stem}.weight")
    if plain:
        logger.info("%d GGUF weights are dequantized at load (modules without a GGUF path, e.g. %s)",
                    len(set(plain)), plain[0])
    return served


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {folder}: {e}") from e
