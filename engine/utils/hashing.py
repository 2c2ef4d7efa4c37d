"""Hash functions for prefix-cache block hashes, chosen by name.

vLLM twin: ``vllm/utils/hashing.py`` (``sha256``, ``get_hash_fn_by_name``).
Read it for: what a block hash is made of -- ``pickle`` turns the tuple
``(parent hash, token ids, extra keys)`` into bytes, SHA-256 turns those into a
32-byte digest. Pickle is stable for the same Python objects across processes,
so the front end and the engine core agree on every hash.
Sessions: 03 (KV cache).

Simpler than vLLM: only ``sha256``. vLLM also offers ``sha256_cbor`` (CBOR
instead of pickle, for hashes that non-Python consumers of KV events can
recompute) and the faster ``xxhash`` / ``xxhash_cbor``; Glassbox has no KV
events and depends on neither ``cbor2`` nor ``xxhash``. No ``safe_hash``
(vLLM's md5-with-FIPS-fallback for config hashes). Imports no torch: the
scheduler side uses it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any


def sha256(input: Any) -> bytes:
    """SHA-256 of the pickled object (highest pickle protocol); no seed mixed in."""
    return hashlib.sha256(pickle.dumps(input, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:
    """The hash function named by ``CacheConfig.prefix_caching_hash_algo``."""
    if hash_fn_name == "sha256":
        return sha256
    raise ValueError(
        f"Unsupported hash function: {hash_fn_name} (Glassbox implements only 'sha256')"
    )
