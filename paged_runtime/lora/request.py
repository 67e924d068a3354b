"""Which adapter a request runs with, and the engine's LoRA bounds (torch-free).

An adapter is known by its name (what clients send as ``model``) and a positive integer id (what the scheduler
and the workers key it by); its folder is read by each worker on first use (``lora/peft.py``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: one adapter, by name, id and folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRAError(ValueError):
    """An adapter that cannot be served (malformed folder, rank over the bound, a target the model lacks); the
    message says why. The front ends answer it with a 400."""


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's bounds: ``max_loras`` adapters in one step (device slots), ``max_lora_rank`` the largest
    rank a slot holds, ``max_cpu_loras`` adapters kept in host memory (>= max_loras)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @property
    def cpu_capacity(self) -> int:
        return max(self.max_loras, self.max_cpu_loras or self.max_loras)


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: the name clients send, the adapter folder, and the base it names."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(entries: list[str | dict]) -> list[LoRAModule]:
    """``--lora-modules`` entries as vLLM takes them: ``name=path``, or JSON ``{"name", "path",
    "base_model_name"}`` (a text or a dict: a Ray config's); ValueError names a malformed one."""
    modules = []
    for entry in entries:
        if isinstance(entry, str) and entry.lstrip().startswith("{"):
            try:
                entry = json.loads(entry)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {entry!r} is not valid JSON: {e}") from None
        if isinstance(entry, dict):
            unknown = set(entry) - {"name", "path", "base_model_name"}
            if unknown or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
                raise ValueError(f"--lora-modules {entry!r}: give a name and a path (and optionally a "
                                 "base_model_name)")
            modules.append(LoRAModule(entry["name"], entry["path"], entry.get("base_model_name")))
            continue
        name, sep, path = str(entry).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {entry!r}: expected name=path")
        modules.append(LoRAModule(name, path))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return modules


def parse_lora_module_list(text: str) -> list[str]:
    """``--lora-modules`` given as one text (an environment variable, a Ray argument): a JSON list, one JSON
    object, or ``name=path`` words."""
    text = text.strip()
    if text.startswith("["):
        return [e if isinstance(e, str) else json.dumps(e) for e in json.loads(text)]
    if text.startswith("{"):
        return [text]
    return [word for word in re.split(r"[\s,]+", text) if word]
