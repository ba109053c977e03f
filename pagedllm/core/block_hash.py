"""Chained block hashes for the prefix cache.

The hash of a full block covers its parent's hash, its token ids and extra keys (a per-request
cache salt), so equal hashes mean equal prefixes, not merely equal blocks. xxh3-128 keeps the
chance of a collision (which would silently reuse wrong KV) negligible at any realistic scale.
"""
from __future__ import annotations

from array import array

import xxhash

_NONE_HASH = 0  # parent hash of the first block


def hash_block_tokens(parent_hash: int | None, token_ids: list[int] | tuple[int, ...],
                      extra_key: str | None = None) -> int:
    h = xxhash.xxh3_128()
    h.update((parent_hash or _NONE_HASH).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\x00salt\x00")
        h.update(extra_key.encode())
    return h.intdigest()


def extend_block_hashes(block_hashes: list[int], token_ids: list[int], block_size: int,
                        extra_key: str | None = None) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet (in place)."""
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(len(block_hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        block_hashes.append(parent)
