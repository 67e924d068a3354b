"""Build a draft model from a target's first layers (same embeddings, head and tokenizer).

Where no small sibling model can be downloaded, the target's own first layers
make a draft with the same vocabulary whose guesses are correlated with the
target's: cheap, honest, and what the tests and benchmarks use.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_truncated_draft(target: Path, out: Path, num_layers: int) -> Path:
    """Write ``target``'s first ``num_layers`` layers as a Hugging Face folder at ``out``."""
    target, out = Path(target), Path(out)
    config = json.loads((target / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{config['num_hidden_layers']}, got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for file in sorted(target.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                layer = _LAYER.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    for file in target.iterdir():
        if file.suffix in (".json", ".txt", ".model") and file.name != "config.json" and file.is_file():
            shutil.copy(file, out / file.name)
    return out
