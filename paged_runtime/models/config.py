"""The model's shape, read from a Hugging Face ``config.json``.

``ModelConfig.from_dict`` reads the fields every family reads alike, then hands the result to the family's
config hook (``models/registry.py``; each family file registers its own), which adjusts what that family
reads differently. Importing this module imports no torch; reading a config does (the registry imports
the family files on its first lookup).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from paged_runtime.models import registry


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Non-default RoPE parameters as Hugging Face's rope_parameters (rope_type, its factors, and
    # partial_rotary_factor); None: plain RoPE over whole heads.
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str | None
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    # Per decoder layer: its attention's sliding window (None: full context). Empty: no layer slides.
    layer_windows: tuple[int | None, ...] = ()
    # The whole config.json, for what one family alone reads (Gemma's scalars, experts, LongRoPE factors).
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def window(self, layer_index: int) -> int | None:
        return self.layer_windows[layer_index] if self.layer_windows else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """The fields every family reads alike, then the family's own reading (its registered config hook)."""
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        family = registry.family(architecture)  # ValueError naming the supported ones
        config = cls._generic(architecture, raw)
        return family.config_hook(config) if family.config_hook else config

    @classmethod
    def _generic(cls, architecture: str, raw: dict) -> ModelConfig:
        """config.json read as most families mean it: ``sliding_window`` on the layers ``layer_types`` marks
        "sliding_attention" (none without it), no attention bias unless stated, RoPE as ``rope_scaling``."""
        num_heads = raw["num_attention_heads"]
        # transformers 5 folds rope settings into `rope_parameters`; 4.x uses rope_theta/rope_scaling.
        rope = raw.get("rope_parameters") or {}
        sliding = raw.get("sliding_window")
        max_len = raw.get("max_position_embeddings", 2048)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling(raw, max_len),
            max_position_embeddings=max_len,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            layer_windows=windows_from_types(raw.get("layer_types"), sliding),
            raw=raw,
        )


# ---- helpers for the families' config hooks ------------------------------------------------
def windows_from_types(types: list[str] | None, sliding: int | None) -> tuple[int | None, ...]:
    """Per layer: ``sliding`` where ``types`` says "sliding_attention", else None; empty where no layer
    slides (no window, no types, or no sliding type)."""
    if not sliding or not types or "sliding_attention" not in types:
        return ()
    return tuple(sliding if t == "sliding_attention" else None for t in types)


def every_layer_slides(config: ModelConfig) -> ModelConfig:
    """``sliding_window`` on every layer (Mistral-style: Hugging Face ignores these families' layer_types)."""
    window = config.sliding_window
    return dataclasses.replace(config, layer_windows=(window,) * config.num_layers if window else ())


def rope_scaling(raw: dict, max_len: int, renamed: dict[str, str] | None = None,
                 longrope_original: int | None = None) -> dict | None:
    """Non-default RoPE parameters (``rope_scaling``, or transformers 5's ``rope_parameters``), completed as
    transformers completes them: partial_rotary_factor (kept only when < 1) and, for LongRoPE, the original
    length and ``factor``. ``renamed``: a family's old names for a rope type; ``longrope_original``: its
    config class's default original length (else the parameters' own, else ``max_len``); a top-level
    ``original_max_position_embeddings`` wins over both."""
    rope = raw.get("rope_parameters") or {}
    scaling = dict(raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else {}))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = (renamed or {}).get(kind, kind)
    partial = scaling.get("partial_rotary_factor", rope.get("partial_rotary_factor",
                                                                raw.get("partial_rotary_factor", 1.0)))
    if kind == "default" and partial == 1.0:
        return None
    if partial != 1.0:
        scaling["partial_rotary_factor"] = partial
    if kind == "longrope":
        scaling["rope_type"] = kind
        original = raw.get("original_max_position_embeddings") or (
            longrope_original or scaling.get("original_max_position_embeddings", max_len))
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = max_len / original
    return scaling

