"""The KV cache's settings: the latent pool's size and the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import option
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

    def __post_init__(self):
        # each way is checked where it decides the size (an overridden one is not read)
        if self.max_total_tokens is not None:
            if self.max_total_tokens < 1:
                raise UserError("--max-total-tokens must be at least 1")
        elif self.kv_cache_gb is not None:
            if not self.kv_cache_gb > 0:
                raise UserError("--kv-cache-gb must be positive")
        elif not 0 < self.mem_fraction_static <= 1:
            raise UserError("--mem-fraction-static must be in (0, 1]")
