"""The model's shape, read from a Hugging Face ``config.json``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Families whose ``sliding_window`` applies to every layer (Hugging Face ignores their ``layer_types``).
EVERY_LAYER_SLIDES = ("MistralForCausalLM", "MixtralForCausalLM")


def layer_windows(architecture: str, raw: dict, sliding: int | None) -> tuple[int | None, ...]:
    """Each decoder layer's sliding window as Hugging Face applies it (empty: no layer slides).

    Mistral-style: every layer slides. Otherwise ``layer_types`` says which layers do ("sliding_attention");
    without it, Qwen2 slides layers i >= ``max_window_layers`` (its config's default ``layer_types``)."""
    if not sliding or architecture == "LlamaForCausalLM":  # Hugging Face's Llama attends to everything
        return ()
    num_layers = raw["num_hidden_layers"]
    if architecture in EVERY_LAYER_SLIDES:
        return (sliding,) * num_layers
    types = raw.get("layer_types")
    if types is None and architecture == "Qwen2ForCausalLM":
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not types or "sliding_attention" not in types:
        return ()
    return tuple(sliding if t == "sliding_attention" else None for t in types)


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
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = raw["num_attention_heads"]
        # transformers 5 folds rope settings into `rope_parameters`; 4.x uses rope_theta/rope_scaling.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        sliding = raw.get("sliding_window")
        if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding = None
        if architecture == "Qwen3ForCausalLM":
            if raw.get("use_sliding_window", False):
                # Qwen3 slides only its layers past max_window_layers; attention here is the same on every layer.
                raise ValueError("Qwen3ForCausalLM with use_sliding_window=true is not supported: attention here is "
                                 "full-context on every layer (set use_sliding_window to false in config.json)")
            sliding = None
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
            rope_scaling=scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding,
            layer_windows=layer_windows(architecture, raw, sliding),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            raw=raw,
        )
