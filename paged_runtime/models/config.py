"""The model's shape, read from a Hugging Face ``config.json``."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                           "Phi3ForCausalLM")
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
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = raw["num_attention_heads"]
        # transformers 5 folds rope settings into `rope_parameters`; 4.x uses rope_theta/rope_scaling.
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        sliding = raw.get("sliding_window")
        if architecture in ("Qwen2ForCausalLM", "Qwen3MoeForCausalLM") and not raw.get("use_sliding_window", False):
            sliding = None
        if architecture == "Qwen3ForCausalLM":
            if raw.get("use_sliding_window", False):
                # Qwen3 slides only its layers past max_window_layers; attention here is the same on every layer.
                raise ValueError("Qwen3ForCausalLM with use_sliding_window=true is not supported: attention here is "
                                 "full-context on every layer (set use_sliding_window to false in config.json)")
            sliding = None
        max_len = raw.get("max_position_embeddings", 2048)
        scaling = _rope_scaling(raw, scaling, architecture, max_len)
        windows = layer_windows(architecture, raw, sliding)
        if architecture == "Phi3ForCausalLM":
            windows, sliding = _phi3_windows(raw, max_len), None
        config = cls(
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
            max_position_embeddings=max_len,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            layer_windows=windows,
            raw=raw,
        )
        if architecture == "Gemma3ForCausalLM":
            config = dataclasses.replace(config, **gemma3_fields(raw))
        return config


# ---- Gemma 3 -----------------------------------------------------------------------------
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma3_layer_types(raw: dict) -> list[str]:
    """Each decoder layer's kind: ``layer_types``, or else the older ``sliding_window_pattern`` P (every P-th
    layer full, the rest sliding; Hugging Face's default P is 6)."""
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= set(GEMMA3_LAYER_TYPES):
        raise ValueError(f"Gemma3 layer_types must name each of the {n} layers one of {GEMMA3_LAYER_TYPES}, "
                         f"got {types}")
    return list(types)


def gemma3_rope(raw: dict) -> dict[str, tuple[float, dict | None]]:
    """Per layer kind, RoPE's (base, scaling): global layers ``rope_theta`` with ``rope_scaling``, local ones
    ``rope_local_base_freq`` unscaled (transformers 4.x keys); transformers 5 keys ``rope_parameters`` by kind."""
    params = raw.get("rope_parameters") or {}
    if not set(params) & set(GEMMA3_LAYER_TYPES):
        params = {"full_attention": {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1e6)},
                  "sliding_attention": {"rope_theta": raw.get("rope_local_base_freq", 1e4)}}
    rope = {}
    for kind, default_base in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        p = params.get(kind) or {}
        scaled = p.get("rope_type", p.get("type", "default")) != "default"
        rope[kind] = (p.get("rope_theta", default_base), p if scaled else None)
    return rope


def gemma3_fields(raw: dict) -> dict:
    """What Gemma 3 reads differently: windows per layer (``sliding_window`` is None, so that max_model_len is
    not capped to the local layers' window), the global layers' RoPE, tied embeddings unless said otherwise."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM with use_bidirectional_attention=true (an embedding model) is not "
                         "supported: attention here is causal")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma3ForCausalLM with hidden_activation {activation!r} is not supported "
                         "(only gelu_pytorch_tanh)")
    window = raw.get("sliding_window")
    theta, scaling = gemma3_rope(raw)["full_attention"]
    return dict(layer_windows=tuple(window if t == "sliding_attention" else None for t in gemma3_layer_types(raw)),
                sliding_window=None, rope_theta=theta, rope_scaling=scaling,
                tie_word_embeddings=raw.get("tie_word_embeddings", True))


def _rope_scaling(raw: dict, scaling: dict | None, architecture: str, max_len: int) -> dict | None:
    """``scaling`` completed as transformers completes it: partial_rotary_factor (kept only when < 1) and, for
    LongRoPE, the original length (a top-level key wins; Phi3Config's default is 4096) and ``factor``."""
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if architecture == "Phi3ForCausalLM" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config's names for it in early checkpoints
    rope = raw.get("rope_parameters") or {}
    partial = scaling.get("partial_rotary_factor", rope.get("partial_rotary_factor",
                                                                raw.get("partial_rotary_factor", 1.0)))
    if kind == "default" and partial == 1.0:
        return None
    if partial != 1.0:
        scaling["partial_rotary_factor"] = partial
    if kind == "longrope":
        scaling["rope_type"] = kind
        original = raw.get("original_max_position_embeddings") or (
            4096 if architecture == "Phi3ForCausalLM" else scaling.get("original_max_position_embeddings", max_len))
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = max_len / original
    return scaling


def _phi3_windows(raw: dict, max_len: int) -> tuple[int | None, ...]:
    """transformers applies Phi-3's ``sliding_window`` on every layer (a sliding-window causal mask); one at
    least max_position_embeddings long (Phi-3.5 and Phi-4-mini: 262144) masks nothing."""
    window = raw.get("sliding_window")
    return (window,) * raw["num_hidden_layers"] if window and window < max_len else ()
