"""Convert a Llama-family GGUF checkpoint into a Hugging Face-style model folder.

Contract
--------
``convert_gguf(gguf_path, out_dir) -> Path`` reads ``gguf_path`` with the
``gguf`` package (never through transformers' model loading) and writes
``out_dir`` containing:

* ``config.json`` -- ``LlamaForCausalLM`` config (``Qwen2ForCausalLM`` for
  ``qwen2`` files): sizes, head counts, ``head_dim``, ``rms_norm_eps``,
  ``rope_theta`` (also as transformers 5 ``rope_parameters``),
  ``max_position_embeddings``, ``tie_word_embeddings`` (true when the GGUF has
  no ``output.weight``), bos/eos/pad ids, ``torch_dtype`` "bfloat16" (the
  dtype the runtime serves in), ``hidden_act`` "silu", ``attention_bias``
  (false for llama; true for qwen2, meaning q/k/v biases).
* ``model.safetensors`` -- every tensor dequantized to float32 under its HF
  name (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.*``,
  ``model.layers.{i}.mlp.*``, the two layer norms, ``model.norm.weight``, and
  ``lm_head.weight`` only when untied).  ``attn_q``/``attn_k`` rows are put back
  in HF order (llama.cpp permutes them for its rotary layout).
* ``tokenizer.json``, ``tokenizer_config.json`` (with the GGUF chat template),
  ``chat_template.jinja``, ``special_tokens_map.json``,
  ``generation_config.json``.

Supported ``general.architecture``: "llama" ("mistral" as an alias) and
"qwen2".  The folder is built in a temporary sibling directory and renamed into
place, so a crash never leaves a half-written ``out_dir``; an existing
``out_dir`` is replaced.  ``ValueError`` is raised for a file that is not a
readable GGUF (corrupt, truncated), an unsupported architecture, or tensors
this converter does not know how to map.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["convert_gguf", "CONVERTER_VERSION"]

# Bump when the output format changes so caches keyed on it get rebuilt.
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class _Arch:
    hf_class: str
    model_type: str
    permute_qk: bool  # llama.cpp only permutes q/k for llama-style models
    qkv_bias: bool  # qwen2 carries q/k/v biases


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", permute_qk=True, qkv_bias=False),
    "mistral": _Arch("LlamaForCausalLM", "llama", permute_qk=True, qkv_bias=False),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", permute_qk=False, qkv_bias=True),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_MISSING = object()


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_path`` into an HF folder at ``out_dir``; return ``out_dir``."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open_reader(gguf_path)
    hp = _read_hparams(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors = _convert_tensors(reader, hp)
        tied = "lm_head.weight" not in tensors
        _save_safetensors(tensors, tmp / "model.safetensors")
        del tensors  # ~4 bytes/parameter; free before the tokenizer step
        ids = _special_ids(reader)
        _write_json(tmp / "config.json", _build_config(hp, ids, tied))
        _write_json(tmp / "generation_config.json", _generation_config(ids))
        _write_tokenizer(gguf_path, reader, tmp)
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


def _f32(x: float) -> float:
    # GGUF stores float32; the shortest float32 repr gives back e.g. 1e-05
    # instead of 9.999999747378752e-06.
    return float(str(np.float32(x)))


def _read_hparams(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHS)}"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"unsupported rope scaling {scaling!r} in GGUF")
    p = lambda key, default=_MISSING: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    hidden, n_head = int(p("embedding_length")), int(p("attention.head_count"))
    return {
        "arch": arch,
        "spec": _ARCHS[arch],
        "n_layer": int(p("block_count")),
        "hidden": hidden,
        "ffn": int(p("feed_forward_length")),
        "n_head": n_head,
        "n_head_kv": int(p("attention.head_count_kv", n_head)),
        "head_dim": int(p("attention.key_length", hidden // n_head)),
        "eps": _f32(p("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(p("rope.freq_base", 10000.0)),
        "ctx": int(p("context_length", 2048)),
        "vocab": _vocab_size(reader),
    }


def _vocab_size(reader) -> int:
    # The embedding matrix is authoritative; metadata vocab_size is optional.
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # GGUF order: [n_embd, n_vocab]
    raise ValueError("GGUF has no token_embd.weight tensor")


# --------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, spec: _Arch) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    layer, part, kind = m.groups()
    if kind == "bias" and not (spec.qkv_bias and part in ("attn_q", "attn_k", "attn_v")):
        raise ValueError(f"unsupported GGUF bias tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _expected_names(hp: dict) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(hp["n_layer"]):
        names |= {f"model.layers.{i}.{v}.weight" for v in _BLOCK_NAMES.values()}
        if hp["spec"].qkv_bias:
            names |= {f"model.layers.{i}.self_attn.{x}_proj.bias" for x in "qkv"}
    return names


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of llama.cpp's convert_hf_to_gguf permute():
    #   w.reshape(n_head, 2, d, *rest).swapaxes(1, 2).reshape(shape)
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_tensors(reader, hp: dict) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name, hp["spec"])
        try:
            # dequantize returns numpy order (GGUF shapes are listed reversed).
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise ValueError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from exc
        if hp["spec"].permute_qk and ".attn_q." in t.name:
            w = _unpermute(w, hp["n_head"])
        elif hp["spec"].permute_qk and ".attn_k." in t.name:
            w = _unpermute(w, hp["n_head_kv"])
        out[name] = np.ascontiguousarray(w)
    missing = _expected_names(hp) - out.keys()
    if missing:
        raise ValueError(f"GGUF is missing tensors, e.g. {sorted(missing)[:3]}")
    return out


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
    return {
        "architectures": [spec.hf_class],
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


def _generation_config(ids: dict) -> dict:
    return {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- tokenizer


def _write_tokenizer(gguf_path: Path, reader, out: Path) -> None:
    from transformers import AutoTokenizer

    # Load from a private folder holding only the GGUF so stray tokenizer
    # files next to the original cannot shadow the GGUF's vocabulary.
    with tempfile.TemporaryDirectory(dir=out) as scratch:
        link = Path(scratch) / gguf_path.name
        link.symlink_to(gguf_path.resolve())
        tok = AutoTokenizer.from_pretrained(scratch, gguf_file=link.name, local_files_only=True)
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)
    _patch_tokenizer_config(out / "tokenizer_config.json", reader, template)
    specials = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    _write_json(out / "special_tokens_map.json", {k: v for k, v in specials.items() if v})
    _check_eos(tok, reader)


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
