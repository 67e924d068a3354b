"""A KV-event subscriber's side, written from vLLM's published definitions rather than from the runtime: block
hashes recomputed with hashlib and a CBOR encoder of its own, and the ZMQ replay protocol spoken by a DEALER."""
from __future__ import annotations

import hashlib
import pickle

import msgpack
import zmq

END_SEQ = b"\xff" * 8  # sequence -1, 8 bytes big-endian: the end of a replay


def low64(h: bytes) -> int:
    """vLLM's integer form of a block hash in events: the digest as a big-endian int, masked to 64 bits."""
    return int.from_bytes(h, "big") & (2**64 - 1)


def cbor(value) -> bytes:
    """RFC 8949 deterministic CBOR of None, unsigned ints, byte and text strings and arrays (what a block hash
    input holds)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        return _cbor_head(3, len(value.encode())) + value.encode()
    return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << 8 * size:
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def sha256_cbor(value) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def sha256_pickle(value) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_block_hashes(algo: str, seed: str, token_ids: list[int], block_size: int,
                      salt: str | None = None) -> list[bytes]:
    """vLLM's hashes of the full blocks of ``token_ids``: H((parent, tokens, extra_keys)), the first parent
    H(PYTHONHASHSEED), the first block's extra keys (salt,) when salted."""
    h = {"sha256_cbor": sha256_cbor, "sha256": sha256_pickle}[algo]
    parent, hashes = h(seed), []
    for i in range(len(token_ids) // block_size):
        extra = (salt,) if salt and i == 0 else None
        parent = h((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra))
        hashes.append(parent)
    return hashes


def receive(sock, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), f"nothing arrived in {timeout_ms} ms"
    return sock.recv_multipart()


def ask_replay(endpoint: str, start: int, timeout_ms: int = 5000) -> list[list[bytes]]:
    """Every reply (frames after the delimiter) of the replay socket to a DEALER asking from ``start``, the end
    marker's included."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        replies = []
        while True:
            frames = receive(dealer, timeout_ms)
            assert frames[0] == b"", frames  # the delimiter
            replies.append(frames[1:])
            if frames[-1] == b"":
                return replies
    finally:
        dealer.close(linger=0)


def replayed_batches(endpoint: str, start: int = 0) -> list[tuple[int, list]]:
    """(seq, decoded events) of every buffered batch from ``start`` on (the array format's replies)."""
    replies = ask_replay(endpoint, start)
    assert replies[-1] == [END_SEQ, b""], replies[-1]
    return [(int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]) for seq, payload in replies[:-1]]
