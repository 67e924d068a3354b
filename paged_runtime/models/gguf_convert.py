"""Convert a GGUF checkpoint into a Hugging Face-style model folder.

Contract
--------
``convert_gguf(gguf_path, out_dir) -> Path`` reads ``gguf_path`` with the
``gguf`` package (never through transformers' model loading) and writes
``out_dir`` containing:

* ``config.json`` -- the config of the family's HF class (see the table below):
  sizes, head counts, ``head_dim``, ``rms_norm_eps``, ``rope_theta`` (also as
  transformers 5 ``rope_parameters``), ``max_position_embeddings``,
  ``tie_word_embeddings`` (true when the GGUF has no ``output.weight``),
  bos/eos/pad ids, ``torch_dtype`` "bfloat16" (the dtype the runtime serves
  in), plus the family's own keys, spelled as its published checkpoints spell
  them (experts, windows, rope scaling, ...).
* ``model.safetensors`` -- every tensor dequantized to float32 under the name
  the family's published HF checkpoints use (MoE experts one tensor per expert:
  ``block_sparse_moe.experts.{e}.w1`` / ``mlp.experts.{e}.gate_proj``...).
  llama.cpp's storage conventions are undone: ``attn_q``/``attn_k`` rows are
  put back in HF order for llama-style files (llama.cpp permutes them for its
  rotary layout), Gemma's RMSNorm weights lose the +1 llama.cpp folds in, and
  stacked ``ffn_*_exps`` tensors ``[E, ...]`` (or the older one-per-expert
  ``blk.{i}.ffn_gate.{e}``) are split per expert.
* ``gguf/blocks.safetensors`` and ``gguf/types.json`` -- the file's quantized
  tensors as they are, for serving them quantized (``layers/quantization/gguf``):
  for each HF weight ``X.weight`` stored in a block type the runtime serves,
  ``X.qweight`` (uint8 ``[rows, row_bytes]``, the rows' blocks, with the same
  row reordering as above) and ``X.qweight_type`` (int64 ``[rows]``, each
  row's GGMLQuantizationType id, so a fused matrix splits like its rows); ``types.json`` maps every quantized HF weight
  name, served or not, to its type name (an unserved type is refused when the
  model is served quantized, and dequantized with ``--quantization none``).
* ``tokenizer.json``, ``tokenizer_config.json`` (with the GGUF chat template),
  ``chat_template.jinja``, ``special_tokens_map.json``,
  ``generation_config.json`` (Gemma 3 and Phi-3 list their end-of-turn token
  beside eos, as their published generation configs do).

Which ``general.architecture`` converts to which HF class is the model
registry's (``models/registry.py``): each family file registers a ``GgufSpec``
(``models/gguf_spec.py``) naming the llama.cpp architectures it converts from,
its tensor names, the conventions to undo and a hook for its own config.json
keys. A name two families share ("llama", "mistral") goes to the one with
experts when the file's ``<arch>.expert_count`` > 0 (Mixtral), else to the
other (Llama). This module holds no per-family table.

The folder is built in a temporary sibling directory and renamed into place,
so a crash never leaves a half-written ``out_dir``; an existing ``out_dir`` is
replaced.  ``ValueError`` is raised for a file that is not a readable GGUF
(corrupt, truncated), an unsupported architecture (the message lists the
supported ones), or tensors this converter does not know how to map.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from paged_runtime.models import registry
from paged_runtime.models.gguf_spec import GgufSpec, f32

__all__ = ["convert_gguf", "CONVERTER_VERSION", "SUPPORTED_GGUF_ARCHITECTURES"]

# Bump when the output format changes so caches keyed on it get rebuilt.
CONVERTER_VERSION = 3  # 3: the gguf/ block tensors


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Files from llama.cpp before April 2024 (most published Mixtral GGUFs) store one tensor per expert.
_ONE_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
_MISSING = object()


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_path`` into an HF folder at ``out_dir``; return ``out_dir``."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_reader(gguf_path)
    hp = _read_hparams(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors, blocks, types = _convert_tensors(reader, hp)
        tied = "lm_head.weight" not in tensors
        _save_safetensors(tensors, tmp / "model.safetensors")
        del tensors  # ~4 bytes/parameter; free before the tokenizer step
        (tmp / "gguf").mkdir()
        _save_safetensors(blocks, tmp / "gguf" / "blocks.safetensors")
        _write_json(tmp / "gguf" / "types.json", types)
        ids = _special_ids(reader)
        _write_json(tmp / "config.json", _build_config(hp, ids, tied))
        _write_json(tmp / "generation_config.json", _generation_config(ids, _end_of_turn_id(reader, hp["spec"])))
        _write_tokenizer(gguf_path, reader, tmp, hp["spec"].model_type)
        _make_readable(tmp)
        _install(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# --------------------------------------------------------------------------- reading


def _open_reader(path: Path):
    import gguf

    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
        # The reader memory-maps lazily; a truncated file can still yield
        # short tensor views, so check every tensor's byte count.
        bad = [t.name for t in reader.tensors if t.data.nbytes != t.n_bytes]
    except Exception as exc:  # the reader raises assorted errors on garbage
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated): {exc}") from exc
    if bad:
        raise ValueError(f"{path} is truncated: tensor data missing for {bad[:3]}")
    if not reader.tensors:
        raise ValueError(f"{path} contains no tensors")
    return reader


def _field(reader, key: str, default=_MISSING):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _read_hparams(reader) -> dict:
    arch = _field(reader, "general.architecture")
    candidates = registry.gguf_families(arch)
    if not candidates:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {list(registry.gguf_architectures())}"
        )
    p = lambda key, default=_MISSING: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    n_expert = int(p("expert_count", 0))
    family = _by_experts(candidates, n_expert)
    if family is None:
        raise ValueError(f"GGUF architecture {arch!r} with expert_count {n_expert} is not supported")
    spec = family.gguf
    hidden, n_head = int(p("embedding_length")), int(p("attention.head_count"))
    return {
        "arch": arch,
        "hf_class": family.architecture,
        "spec": spec,
        "meta": p,
        "n_layer": int(p("block_count")),
        "hidden": hidden,
        "ffn": int(p("feed_forward_length", None) or p("expert_feed_forward_length")),
        "n_head": n_head,
        "n_head_kv": int(p("attention.head_count_kv", n_head)),
        "head_dim": int(p("attention.key_length", hidden // n_head)),
        "eps": f32(p("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(p("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(p, spec),
        "ctx": int(p("context_length", 2048)),
        "vocab": _vocab_size(reader),
        "n_expert": n_expert,
        "config_tensors": _config_tensors(reader, spec),
    }


def _by_experts(candidates: tuple[registry.ModelFamily, ...], n_expert: int) -> registry.ModelFamily | None:
    """The family with experts for a file with experts, the one without for one without (llama.cpp writes
    Mixtral as "llama" with experts); None where the name's families have no such variant."""
    return next((f for f in candidates if bool(f.gguf.experts) == (n_expert > 0)), None)


def _rope_scaling(p, spec: GgufSpec) -> dict | None:
    kind = p("rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind in spec.rope_scalings:
        return {"rope_type": kind, "factor": f32(p("rope.scaling.factor"))}
    raise ValueError(f"unsupported rope scaling {kind!r} in GGUF")


def _config_tensors(reader, spec: GgufSpec) -> dict[str, list[float]]:
    # Small float32 vectors (Phi-3's LongRoPE factors) that belong in config.json.
    return {t.name: [f32(x) for x in np.asarray(t.data, np.float32).reshape(-1)]
            for t in reader.tensors if t.name in spec.config_tensors}


def _vocab_size(reader) -> int:
    # The embedding matrix is authoritative; metadata vocab_size is optional.
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # GGUF order: [n_embd, n_vocab]
    raise ValueError("GGUF has no token_embd.weight tensor")


# --------------------------------------------------------------------------- tensors


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of llama.cpp's convert_hf_to_gguf permute():
    #   w.reshape(n_head, 2, d, *rest).swapaxes(1, 2).reshape(shape)
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(gguf_name: str, w: np.ndarray, hp: dict):
    """Yield ``(hf_name, array)`` for one GGUF tensor (several for stacked experts)."""
    spec = hp["spec"]
    if spec.norm_offset and gguf_name.endswith("norm.weight"):
        w = w - np.float32(spec.norm_offset)
    if gguf_name in _GLOBAL_NAMES:
        yield _GLOBAL_NAMES[gguf_name], w
        return
    m = _ONE_EXPERT_RE.fullmatch(gguf_name)
    if m and spec.experts and int(m.group(3)) < hp["n_expert"]:
        layer, part, e = m.groups()
        yield f"model.layers.{layer}.{spec.experts[part + '_exps'].format(e=int(e))}.weight", w
        return
    m = _BLOCK_RE.fullmatch(gguf_name)
    part = m and m.group(2)
    if part not in spec.block and part not in spec.experts:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, _, kind = m.groups()
    prefix = f"model.layers.{layer}."
    if kind == "bias" and not (spec.qkv_bias and part in ("attn_q", "attn_k", "attn_v")):
        raise ValueError(f"unsupported GGUF bias tensor {gguf_name!r}")
    if part in spec.experts:
        if w.shape[0] != hp["n_expert"]:
            raise ValueError(f"{gguf_name} holds {w.shape[0]} experts, metadata says {hp['n_expert']}")
        for e in range(w.shape[0]):  # stacked [E, out, in] -> one [out, in] per expert
            yield prefix + spec.experts[part].format(e=e) + ".weight", w[e]
        return
    if spec.permute_qk and part == "attn_q":
        w = _unpermute(w, hp["n_head"])
    elif spec.permute_qk and part == "attn_k":
        w = _unpermute(w, hp["n_head_kv"])
    yield f"{prefix}{spec.block[part]}.{kind}", w


def _expected_names(hp: dict) -> set[str]:
    spec = hp["spec"]
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(hp["n_layer"]):
        prefix = f"model.layers.{i}."
        names |= {f"{prefix}{v}.weight" for v in spec.block.values()}
        names |= {f"{prefix}{v.format(e=e)}.weight" for v in spec.experts.values() for e in range(hp["n_expert"])}
        if spec.qkv_bias:
            names |= {f"{prefix}self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def _convert_tensors(reader, hp: dict) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, str]]:
    """Every tensor dequantized to float32; the quantized ones also as raw blocks (served types only) and
    every quantized weight's type name."""
    from gguf.quants import dequantize

    from paged_runtime.layers.quantization.gguf_blocks import SERVED

    out, blocks, types = {}, {}, {}
    for t in reader.tensors:
        if t.name in hp["spec"].config_tensors:
            continue
        try:
            # dequantize returns numpy order (GGUF shapes are listed reversed).
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise ValueError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from exc
        for name, tensor in _hf_tensors(t.name, w, hp):
            out[name] = np.ascontiguousarray(tensor)
        if t.tensor_type.name not in _PLAIN_TYPES:
            for name, raw in _hf_tensors(t.name, np.asarray(t.data), hp):
                types[name] = t.tensor_type.name
                if t.tensor_type.name in SERVED:
                    stem = name.removesuffix(".weight")
                    blocks[f"{stem}.qweight"] = np.ascontiguousarray(raw)
                    blocks[f"{stem}.qweight_type"] = np.full(len(raw), int(t.tensor_type), dtype=np.int64)
    missing = _expected_names(hp) - out.keys()
    if missing:
        raise ValueError(f"GGUF is missing tensors, e.g. {sorted(missing)[:3]}")
    return out, blocks, types


_PLAIN_TYPES = ("F32", "F16", "BF16", "F64")


def _save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    # "format": "pt" lets transformers load the file as a PyTorch checkpoint.
    save_file(tensors, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------- config


def _special_ids(reader) -> dict:
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}
    ids = {k: _field(reader, f"tokenizer.ggml.{v}", None) for k, v in keys.items()}
    return {k: (None if v is None else int(v)) for k, v in ids.items()}


def _build_config(hp: dict, ids: dict, tied: bool) -> dict:
    spec = hp["spec"]
    cfg = {
        "architectures": [hp["hf_class"]],
        "model_type": spec.model_type,
        "vocab_size": hp["vocab"],
        "hidden_size": hp["hidden"],
        "intermediate_size": hp["ffn"],
        "num_hidden_layers": hp["n_layer"],
        "num_attention_heads": hp["n_head"],
        "num_key_value_heads": hp["n_head_kv"],
        "head_dim": hp["head_dim"],
        "rms_norm_eps": hp["eps"],
        "rope_theta": hp["rope_theta"],
        # transformers 5 reads rope settings from rope_parameters.
        "rope_parameters": {"rope_type": "default", "rope_theta": hp["rope_theta"]},
        "max_position_embeddings": hp["ctx"],
        "tie_word_embeddings": tied,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        # Qwen2 means q/k/v biases (o_proj has none); readers key off this flag.
        "attention_bias": spec.qkv_bias,
        "mlp_bias": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if spec.config_hook is not None:
        spec.config_hook(cfg, hp)
    return cfg


def _generation_config(ids: dict, end_of_turn: int | None) -> dict:
    eos = ids["eos"]
    if end_of_turn is not None and end_of_turn != eos:
        eos = [end_of_turn] if eos is None else [eos, end_of_turn]
    return {
        "bos_token_id": ids["bos"],
        "eos_token_id": eos,
        "pad_token_id": ids["pad"],
    }


def _end_of_turn_id(reader, spec: GgufSpec) -> int | None:
    text = spec.end_of_turn
    tokens = _field(reader, "tokenizer.ggml.tokens", None) if text else None
    return tokens.index(text) if tokens and text in tokens else None


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- tokenizer


def _write_tokenizer(gguf_path: Path, reader, out: Path, model_type: str) -> None:
    # Load from a private folder holding only the GGUF so stray tokenizer
    # files next to the original cannot shadow the GGUF's vocabulary.
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        link = Path(scratch) / gguf_path.name
        link.symlink_to(gguf_path.resolve())
        tok = _tokenizer_class(model_type).from_pretrained(scratch, gguf_file=link.name, local_files_only=True)
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)
    _patch_tokenizer_config(out / "tokenizer_config.json", reader, template)
    specials = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    _write_json(out / "special_tokens_map.json", {k: v for k, v in specials.items() if v})
    _check_eos(tok, reader)


def _tokenizer_class(model_type: str):
    """The class AutoTokenizer picks for a GGUF of this family, without its reading the file again.

    AutoTokenizer learns the model type by parsing the whole GGUF (9 s for the default model's
    49k-token vocabulary, after our own read), then takes the type's registered tokenizer; the
    class matters (Gemma's and Qwen's write other files than the generic one).
    """
    from transformers import AutoConfig, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    found = TOKENIZER_MAPPING.get(type(AutoConfig.for_model(model_type)), None)
    if isinstance(found, tuple):  # transformers 4: (slow, fast)
        found = found[1] or found[0]
    return found or PreTrainedTokenizerFast  # transformers 5's fallback, TokenizersBackend, by its old name


def _patch_tokenizer_config(path: Path, reader, template: str | None) -> None:
    cfg = json.loads(path.read_text(encoding="utf-8"))
    # save_pretrained records how the tokenizer was loaded; meaningless here.
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    # transformers 5 writes "TokenizersBackend", unknown to v4; this name
    # loads the same tokenizer.json-backed class in both.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    cfg["add_eos_token"] = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    if template is not None:
        # transformers 5 keeps it in chat_template.jinja; older readers look here.
        cfg["chat_template"] = template
    _write_json(path, cfg)


def _check_eos(tok, reader) -> None:
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id", None)
    if eos_id is not None and tok.eos_token_id != int(eos_id):
        raise ValueError(f"tokenizer eos id {tok.eos_token_id} != GGUF eos id {eos_id}")


# --------------------------------------------------------------------------- install


def _make_readable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only modes; a shared cache needs
    # the usual 755/644.
    folder.chmod(0o755)
    for f in folder.iterdir():
        if f.is_dir():
            _make_readable(f)
        else:
            f.chmod(0o644)


def _install(tmp: Path, out_dir: Path) -> None:
    # A directory rename cannot overwrite a non-empty directory, so move any
    # old copy aside first and delete it only after the new one is in place.
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "x")
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
