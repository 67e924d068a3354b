"""``speculative_config`` as vLLM spells it, validated once at start-up."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_runtime.settings import json_object

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model (method "draft_model")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be in 1..16, "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config.model (the draft model\'s path) is required for "draft_model"')

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI's ``--speculative-config``) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", cls.__dataclass_fields__)
        if "method" not in value:  # vLLM infers the method from what is given
            value["method"] = "draft_model" if value.get("model") else "ngram"
        if value["method"] == "draft":
            value["method"] = "draft_model"
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)
