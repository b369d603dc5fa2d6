"""Chained prefix hashes of full KV blocks, stable across processes and runs.

A block's hash covers its parent's hash, its token ids and any extra keys (a LoRA name,
a cache salt), so equal hashes mean equal prefixes. Python's ``hash()`` is salted per
process, so a keyed cryptographic digest is used instead.
"""

import hashlib
from array import array

from strata.engine_core.protocol import LoRAAdapter

ROOT_HASH = b"\x00" * 16


def hash_block(parent: bytes, token_ids: list[int], extra_keys: bytes = b"") -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_keys)
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: list[int],
    block_size: int,
    extra_keys: bytes = b"",
    salt: str | None = None,
    lora: LoRAAdapter | None = None,
) -> None:
    """Append hashes for every block of ``token_ids`` that is full and not yet hashed.

    ``salt`` (a request's cache salt) and ``lora`` (its adapter) go into the first block's hash
    only: every later hash chains from it, so requests with different salts or adapters share
    no block at all. Without either, the hashes are those of the base model."""
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        keys = extra_keys + _salt_key(salt) + _lora_key(lora) if start == 0 else extra_keys
        parent = hash_block(parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)


def _salt_key(salt: str | None) -> bytes:
    # Tagged, so that no salt and an empty salt stay distinct from every real salt's bytes.
    return b"" if salt is None else b"salt\x00" + salt.encode("utf-8", "surrogatepass")


def _lora_key(lora: LoRAAdapter | None) -> bytes:
    # The load's id as well as the name: a name unloaded and loaded again with other weights
    # gets a new id, so KV computed with the old weights is never a hit.
    if lora is None:
        return b""
    return b"lora\x00" + lora.lora_id.to_bytes(8, "big") + lora.name.encode("utf-8", "surrogatepass")
