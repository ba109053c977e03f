"""Chained block hashes for the prefix cache.

The hash of a full block covers its parent's hash, its token ids and extra keys (a per-request
cache salt), so equal hashes mean equal prefixes, not merely equal blocks. xxh3-128 keeps the
chance of a collision (which would silently reuse wrong KV) negligible at any realistic scale.
"""
from __future__ import annotations

import struct

import xxhash

_NONE_HASH = 0  # parent hash of the first block
_MASK64 = (1 << 64) - 1
# One struct per block length (in practice one: the block size). Packing the parent hash and
# the token ids in a single call is several times cheaper than building an array.
_PACKERS: dict[int, struct.Struct] = {}


def hash_block_tokens(parent_hash: int | None, token_ids: list[int] | tuple[int, ...],
                      extra_key: str | None = None) -> int:
    """xxh3-128 of (parent hash as 16 little-endian bytes, token ids as int64, salt)."""
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<QQ{len(token_ids)}q")
    parent = parent_hash or _NONE_HASH
    data = packer.pack(parent & _MASK64, parent >> 64, *token_ids)
    if extra_key is not None:
        data += b"\x00salt\x00" + extra_key.encode()
    return xxhash.xxh3_128_intdigest(data)


def extend_block_hashes(block_hashes: list[int], token_ids: list[int], block_size: int,
                        extra_key: str | None = None) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet (in place)."""
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(len(block_hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        block_hashes.append(parent)
