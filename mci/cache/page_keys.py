"""Names of KV pages in the lower cache tiers: a chained hash of the token ids, seeded with the
identity of what computed them.

A page is `page_tokens` consecutive positions starting at a multiple of `page_tokens`. Its key
hashes the previous page's key with this page's token ids, so a key names the whole prefix up
to the page's end (two prompts share a page's key only if they share every token before it),
and the chain starts from the identity: the checkpoint (its config and weight files), the
dtype, the cache's layout (rows, latent width, page size) and whether the kernels are
batch-invariant. A page written by another model, dtype or layout is never found, because it
is never asked for.

    identity ─h─ key0 ─h─ key1 ─h─ key2        key_i = sha256(key_{i-1} ‖ tokens of page i)
              tokens[0:P]  tokens[P:2P]  ...
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from pathlib import Path

SAMPLE_BYTES = 1 << 20  # of each weight file's head and tail in its fingerprint


def checkpoint_fingerprint(model_path: str | os.PathLike) -> str:
    """A digest of the checkpoint: config.json, and each safetensors file's name, size, first
    and last MiB (its header and some of its tensors: checkpoints that differ only in their
    values differ there too, and hashing all of a 671B checkpoint would take minutes)."""
    root = Path(model_path)
    digest = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for file in sorted(root.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(size - SAMPLE_BYTES, 0))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def cache_identity(fingerprint: str, **layout) -> str:
    """The identity a store's keys start from: the checkpoint's fingerprint and the layout."""
    text = json.dumps({"checkpoint": fingerprint, **layout}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class PageKeys:
    """Keys of the full pages of a token sequence under one identity."""

    def __init__(self, identity: str, page_tokens: int):
        self.identity = identity
        self.page_tokens = page_tokens

    def keys(self, token_ids: list[int], num_pages: int) -> list[str]:
        """Keys of pages 0..num_pages-1 of `token_ids` (each of them full)."""
        p = self.page_tokens
        if num_pages * p > len(token_ids):
            raise ValueError(f"{num_pages} pages of {p} need more than {len(token_ids)} tokens")
        keys, prev = [], bytes.fromhex(self.identity)
        for i in range(num_pages):
            prev = hashlib.sha256(
                prev + array("q", token_ids[i * p : (i + 1) * p]).tobytes()
            ).digest()
            keys.append(prev.hex())
        return keys
