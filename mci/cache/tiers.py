"""Builds the lower cache tiers a CacheConfig asks for (`--enable-hierarchical-cache`)."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import torch

from mci.cache.config import CacheConfig
from mci.cache.file_store import FileStore
from mci.cache.hierarchy import HierarchicalCache
from mci.cache.host_store import HostStore
from mci.cache.page_keys import PageKeys, cache_identity, checkpoint_fingerprint
from mci.errors import UserError

log = logging.getLogger("mci")

STORE_ID_FILE = "store-id"  # in the store's directory: its id, written once


def open_tiers(
    cache: CacheConfig, model_path: str | os.PathLike, kv_cache: torch.Tensor, batch_invariant: bool
) -> HierarchicalCache:
    """L2 (and L3 with a storage backend) for the pool `kv_cache`. The store's identity is the
    checkpoint, the cache's dtype and layout, and whether the kernels are batch-invariant (a
    deterministic engine's latents are not bit-identical to a default one's)."""
    rows, _, latent = kv_cache.shape
    page = cache.hicache_page_size
    identity = cache_identity(
        checkpoint_fingerprint(model_path),
        dtype=str(kv_cache.dtype),
        rows=rows,
        latent=latent,
        page_tokens=page,
        batch_invariant=batch_invariant,
    )
    page_bytes = rows * page * latent * kv_cache.dtype.itemsize
    num_pages = int(cache.hicache_size * 2**30) // page_bytes
    if num_pages < 1:
        raise UserError(
            f"--hicache-size {cache.hicache_size} GiB holds no page of {page_bytes} bytes"
        )
    pin = kv_cache.device.type == "cuda"
    host = HostStore(num_pages, (rows, page, latent), kv_cache.dtype, pin=pin)
    store = None
    if cache.hicache_storage_backend == "file":
        try:
            os.makedirs(cache.hicache_storage_dir, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--hicache-storage-dir {cache.hicache_storage_dir}: {exc}") from None
        max_bytes = int(cache.hicache_storage_size * 2**30)
        store = FileStore(cache.hicache_storage_dir, max_bytes, identity)
    log.info(
        "hierarchical cache: L2 %d pages of %d tokens (%.1f MB)%s, %s",
        num_pages,
        page,
        num_pages * page_bytes / 1e6,
        f", L3 files in {cache.hicache_storage_dir}" if store else "",
        cache.hicache_write_policy,
    )
    return HierarchicalCache(
        kv_cache, PageKeys(identity, page), host, store, cache.hicache_write_policy == "write_back"
    )


def shared_store_id(cache: CacheConfig) -> str | None:
    """The id of the file store this server uses (None without one): written once into the
    directory, so every replica pointing at the same directory, on any host that mounts it,
    reports the same id (the router treats their stores as one: mci/router/policy.py)."""
    if not (cache.enable_hierarchical_cache and cache.hicache_storage_backend == "file"):
        return None
    path = Path(cache.hicache_storage_dir) / STORE_ID_FILE
    try:
        return _read_or_create_id(path)
    except OSError as exc:
        raise UserError(f"--hicache-storage-dir {cache.hicache_storage_dir}: {exc}") from None


def _read_or_create_id(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STORE_ID_FILE}.{os.getpid()}.{uuid.uuid4().hex}")
    tmp.write_text(uuid.uuid4().hex)
    try:
        os.link(tmp, path)  # fails if another replica got there first: its id is the one
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def shared_store(store_id: str | None, hicache: dict | None) -> str | None:
    """What a replica reports as its shared store (`/server_info`): the directory's id and the
    identity its pages are keyed by, so only replicas that can read each other's pages report
    one store; None unless L3 is on, working, and written through (write-back reaches the disk
    only after two evictions: another replica would rarely find a prefix there)."""
    if store_id is None or not hicache or hicache.get("write_policy") != "write_through":
        return None
    storage = hicache.get("tiers", {}).get("storage")
    if not storage or not storage.get("enabled"):
        return None
    return f"{store_id}-{hicache['identity'][:16]}"
