"""How many tokens the latent KV pool gets: explicit, in GiB, or a fraction of free memory."""

from __future__ import annotations

import torch

from mci.cache.config import CacheConfig


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CPU: MemAvailable from /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def kv_pool_tokens(cache: CacheConfig, bytes_per_token: int, device, cap: int) -> int:
    """Pool size in tokens: explicit, or from GiB, or a fraction of free memory (capped)."""
    if cache.max_total_tokens is not None:
        return cache.max_total_tokens
    if cache.kv_cache_gb is not None:
        return max(1, int(cache.kv_cache_gb * 2**30) // bytes_per_token)
    budget = int(available_memory_bytes(device) * cache.mem_fraction_static)
    return max(1, min(budget // bytes_per_token, cap))
