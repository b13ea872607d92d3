"""Memory accounting (mci/process_memory.py) and the engine's plan (mci/engine/memory_plan.py):
the readings agree with what the process holds, the free-memory bound gives fragmented free
memory back, and the plan's parts add up and bound oneDNN's cache as stated."""

from __future__ import annotations

import os

import pytest

from mci.engine.memory_plan import (
    KERNEL_CACHE_ENV,
    MemoryPlan,
    kernel_cache_capacity,
    step_transient_bytes,
)
from mci.model_config import ModelConfig
from mci.process_memory import CHeap, FreeMemoryBound, MemoryGauge, rss_bytes
from mci.tools.make_checkpoint import PRESETS

MB = 2**20
heap = CHeap()
needs_glibc = pytest.mark.skipif(not heap.available, reason="glibc's mallinfo2 only")


def test_rss_is_this_process():
    held = bytearray(64 * MB)  # touched: resident
    held[::4096] = b"x" * len(held[::4096])
    assert rss_bytes() >= 64 * MB
    assert rss_bytes(os.getpid()) == pytest.approx(rss_bytes(), rel=0.05)
    assert rss_bytes(2**22 + 12345) == 0  # no such process


@needs_glibc
def test_heap_counts_what_is_held():
    before = heap.stats()["heap_in_use_bytes"]
    held = [bytes(64 * 1024) for _ in range(512)]  # 32 MB in the heap's arenas
    grown = heap.stats()["heap_in_use_bytes"] - before
    assert 28 * MB < grown < 48 * MB, grown
    del held


@needs_glibc
def test_free_memory_bound_gives_fragmented_memory_back():
    """Free every other block of 4,096 64 KB blocks: the heap keeps ~128 MB free in holes
    it cannot shrink; the bound trims their pages and RSS falls; it checks again only after
    its interval, and not at all while free memory is under budget."""
    blocks = [bytearray(64 * 1024) for _ in range(4096)]
    kept = blocks[::2]
    del blocks
    assert heap.stats()["heap_free_bytes"] > 100 * MB
    bound = FreeMemoryBound(32 * MB, interval_s=0.0)
    rss = rss_bytes()
    bound.between_steps()
    assert bound.trims == 1
    assert rss_bytes() < rss - 64 * MB
    slow = FreeMemoryBound(32 * MB, interval_s=3600.0)
    slow.between_steps()
    assert slow.trims == 0  # its first check is an interval away
    lenient = FreeMemoryBound(2**40, interval_s=0.0)
    lenient.between_steps()
    assert lenient.trims == 0  # under budget
    del kept


def test_gauge_refreshes_at_most_every_interval():
    gauge = MemoryGauge(min_interval_s=60)
    first = gauge.snapshot()
    held = bytearray(32 * MB)
    held[::4096] = b"x" * len(held[::4096])
    assert gauge.snapshot() is first  # cached
    assert MemoryGauge(0).snapshot()["rss_bytes"] >= first["rss_bytes"]


def test_plan_adds_up_and_scales_with_the_configuration():
    cfg: ModelConfig = PRESETS["small"]
    logits, activations = step_transient_bytes(cfg, 8192 + 256, 256, 4096)
    bigger = step_transient_bytes(cfg, 2 * (8192 + 256), 512, 4096)
    assert bigger[0] > logits and bigger[1] > activations
    plan = MemoryPlan(10, 20, 100, 1000, logits, activations)
    assert plan.kernel_bytes == 100_000
    assert plan.total_bytes == 10 + 20 + 100_000 + logits + activations
    assert plan.as_dict()["total_bytes"] == plan.total_bytes


def test_kernel_cache_capacity_is_set_inside_only(monkeypatch):
    """Set while the engine's first oneDNN work runs, in entries (3 a kernel; a kernel takes
    2), then removed (processes started later size their own); an operator's setting wins."""
    monkeypatch.delenv(KERNEL_CACHE_ENV, raising=False)
    with kernel_cache_capacity(1000) as kernels:
        assert os.environ[KERNEL_CACHE_ENV] == "3000" and kernels == 1500
    assert KERNEL_CACHE_ENV not in os.environ
    monkeypatch.setenv(KERNEL_CACHE_ENV, "700")
    with kernel_cache_capacity(1000) as kernels:
        assert kernels == 350
    assert os.environ[KERNEL_CACHE_ENV] == "700"
    monkeypatch.setenv(KERNEL_CACHE_ENV, "lots")
    with kernel_cache_capacity(1000) as kernels:
        assert kernels == 512  # oneDNN's default of 1,024 entries: it ignores the bad value
