"""Content hashes of full KV blocks, stable across processes, restarts and machines.

A block's hash chains its parent's: ``sha256(msgpack([parent, token_ids, extra_keys]))``,
so equal hashes mean equal whole prefixes, not just equal blocks. The chain starts at a
fixed root (not a per-process random seed), which is what lets a file store shared by
several engines, or a router fed by KV events, agree on what a block is. Extra keys
(the request's cache salt) go into the first block only; the chain carries them on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack

BlockHash = bytes
ROOT_HASH: BlockHash = hashlib.sha256(b"openinfer/kv-block-hash/v1").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    payload = msgpack.packb([parent, list(token_ids), list(extra_keys)], use_bin_type=True)
    return hashlib.sha256(payload).digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` lacks."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else ROOT_HASH
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
