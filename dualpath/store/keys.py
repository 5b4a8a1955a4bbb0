"""Chained prefix keys for Full Blocks (DESIGN.md section 6).

key(block i) = H(key(block i-1) || token ids of block i), so two trajectories
that share a token prefix share exactly the keys (and so the stored blocks) of
the full blocks inside that prefix, and diverge from the first block that
differs. Only full blocks get keys: a partial tail block is recomputed.

H is keyed BLAKE2b with a 16-byte digest written as 32 lowercase hex digits.
The optional `namespace` (e.g. a model id) is the BLAKE2b key, so two models
never share blocks even for identical tokens.

The key format doubles as the server's only path component, so `check_key`
must reject anything else (path traversal, separators, NUL, upper case ...).
"""
from __future__ import annotations

import hashlib
import re
from typing import Sequence

import numpy as np

from .errors import BadKeyError

KEY_HEX_LEN = 32  # 16-byte digest
_KEY_RE = re.compile(r"[0-9a-f]{32}")
_PERSON = b"dpt.kv.v1"  # domain separation from any other BLAKE2b use
_MAX_TOKEN = 2**32  # tokens are hashed as little-endian uint32


def is_valid_key(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def check_key(key: object) -> str:
    """Return the key if it has the key format, else raise BadKeyError."""
    if not is_valid_key(key):
        shown = repr(key)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise BadKeyError(f"bad key {shown}: expected {KEY_HEX_LEN} lowercase hex digits")
    return key  # type: ignore[return-value]


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= _MAX_TOKEN:
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    namespace: bytes = b"",
    parent: str | None = None,
) -> list[str]:
    """Keys of the full blocks of `token_ids`, block_size tokens each.

    `parent` continues an existing chain: pass the key of the block right
    before token_ids[0] (e.g. the last full block of the previous turn).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if len(namespace) > 64:
        raise ValueError("namespace is at most 64 bytes (a BLAKE2b key)")
    prev = bytes.fromhex(check_key(parent)) if parent is not None else b""
    raw = _token_bytes(token_ids)
    stride = 4 * block_size
    keys: list[str] = []
    for start in range(0, len(raw) - stride + 1, stride):
        h = hashlib.blake2b(prev, digest_size=KEY_HEX_LEN // 2, key=namespace, person=_PERSON)
        h.update(raw[start : start + stride])
        prev = h.digest()
        keys.append(prev.hex())
    return keys
