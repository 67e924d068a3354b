"""Prefix-cache block hashes as vLLM defines them (``--prefix-caching-hash-algo``), so an indexer that recomputes
hashes from token ids agrees with the cache.

A full block's hash is ``H((parent, tuple(token_ids), extra_keys))``:

- ``parent``: the previous block's hash; for a request's first block, ``none_hash``, which is
  ``H(PYTHONHASHSEED)`` (the variable's text) when that variable is set and 32 random bytes otherwise
  (vLLM's ``NONE_HASH``: processes share hashes only through a shared ``PYTHONHASHSEED``);
- ``extra_keys``: None, or a tuple: the request's adapter name (LoRA) on every block, then ``cache_salt`` on its
  first block only (vLLM's order, with no multimodal keys between them: this runtime has none); the
  chain carries it into every later block;
- ``H``: ``sha256`` is SHA-256 of the tuple pickled with the highest protocol (vLLM's default; Python's own
  serialization), ``sha256_cbor`` SHA-256 of its canonical CBOR (``cbor2.dumps(..., canonical=True)``:
  byte strings, integers, arrays, null), which any language can rebuild.

The cache keys blocks by the 32-byte digest. KV events carry ``external_hash`` of it: by default the low 64 bits
as an unsigned integer (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, its default since it moved to byte
hashes); with that variable set to 0, the 32 bytes themselves.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


def sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    import cbor2  # here, not at the top: only this algorithm needs it (an image without cbor2 still serves sha256)
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


# config.PREFIX_CACHING_HASH_ALGOS names exactly these
HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


class BlockHasher:
    """One cache's hash function and first-block seed (read from ``PYTHONHASHSEED`` once, at construction)."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in HASH_FUNCTIONS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_FUNCTIONS)}; got {algo!r}")
        self.hash = HASH_FUNCTIONS[algo]
        seed = os.environ.get("PYTHONHASHSEED") if seed is None else seed
        if seed is None and algo == "sha256_cbor":
            logger.warning("PYTHONHASHSEED is not set: the sha256_cbor block hashes start from a random seed, so "
                           "no other process can reproduce them; set it alike wherever they are compared")
        self.none_hash = os.urandom(32) if seed is None else self.hash(seed)

    def __call__(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
        """The hash of a full block of ``token_ids`` after the block hashed ``parent`` (None: the first block)."""
        return self.hash((self.none_hash if parent is None else parent, tuple(token_ids), extra_keys))


def block_extra_keys(index: int, lora_name: str | None, cache_salt: str | None) -> tuple | None:
    """Block ``index``'s extra keys: the adapter's name on every block (vLLM's LoRA key: two adapters never
    share KV, one adapter always can), then the cache salt on the first; None when there are none."""
    keys = ((lora_name,) if lora_name else ()) + ((cache_salt,) if cache_salt and index == 0 else ())
    return keys or None


def external_hash_form() -> Callable[[bytes], int | bytes]:
    """How KV events carry a block hash, per ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default 1: an int)."""
    if os.environ.get(INT_HASHES_ENV, "1").strip() == "0":
        return bytes
    return low_64_bits


def low_64_bits(block_hash: bytes) -> int:
    """vLLM's integer form: the digest read big-endian, masked to 64 bits (its last 8 bytes)."""
    return int.from_bytes(block_hash[-8:], "big")
