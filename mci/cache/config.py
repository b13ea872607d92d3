"""The KV cache's settings: the latent pool's size, the prefix cache and its lower tiers (host
memory, a persistent store: mci/cache/hierarchy.py), with SGLang's flag names."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import check_choices, option
from mci.errors import UserError


@dataclass(frozen=True)
class CacheConfig:
    """Size of the latent KV pool (one of three ways) and the prefix cache."""

    kv_cache_gb: float | None = option(None, "GiB of KV cache (default: a fraction of free memory)")
    mem_fraction_static: float = option(
        0.2, "fraction of free memory for the KV cache when --kv-cache-gb is not given"
    )
    max_total_tokens: int | None = option(
        None, "exact KV pool size in tokens (overrides the above)"
    )
    disable_radix_cache: bool = option(False, "turn the radix prefix cache off")
    enable_hierarchical_cache: bool = option(
        False,
        "keep prefixes the KV pool evicts in host memory (L2) and, with a storage backend, "
        "in a persistent store shared by replicas (L3); a hit loads them back",
    )
    hicache_size: float = option(1.0, "GiB of host memory for L2 (--enable-hierarchical-cache)")
    hicache_page_size: int = option(
        64, "tokens per page of the lower tiers (a page is their unit of storage and of a hit)"
    )
    hicache_write_policy: str = option(
        "write_through",
        "write_through: a prefix is copied down when cached (it survives a crash in L3); "
        "write_back: only when evicted from the tier above",
        choices=("write_through", "write_back"),
    )
    hicache_storage_backend: str | None = option(
        None, "L3 backend: file (pages in --hicache-storage-dir)", choices=("file",)
    )
    hicache_storage_dir: str | None = option(
        None, "directory of the file store; replicas pointing at one directory share it"
    )
    hicache_storage_size: float = option(
        16.0, "GiB the file store may hold (least recently used pages are deleted past it)"
    )

    def __post_init__(self):
        check_choices(self)
        if self.enable_hierarchical_cache:
            self._check_tiers()
        # each way is checked where it decides the size (an overridden one is not read)
        if self.max_total_tokens is not None:
            if self.max_total_tokens < 1:
                raise UserError("--max-total-tokens must be at least 1")
        elif self.kv_cache_gb is not None:
            if not self.kv_cache_gb > 0:
                raise UserError("--kv-cache-gb must be positive")
        elif not 0 < self.mem_fraction_static <= 1:
            raise UserError("--mem-fraction-static must be in (0, 1]")

    def _check_tiers(self) -> None:
        if self.disable_radix_cache:
            raise UserError(
                "--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)"
            )
        if not self.hicache_size > 0:
            raise UserError("--hicache-size must be positive (GiB)")
        if not 1 <= self.hicache_page_size <= 4096:
            raise UserError("--hicache-page-size must be in [1, 4096]")
        if self.hicache_storage_backend == "file":
            if not self.hicache_storage_dir:
                raise UserError("--hicache-storage-backend file needs --hicache-storage-dir")
            if not self.hicache_storage_size > 0:
                raise UserError("--hicache-storage-size must be positive (GiB)")
        elif self.hicache_storage_dir:
            raise UserError("--hicache-storage-dir needs --hicache-storage-backend file")
