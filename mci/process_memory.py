"""What a process's memory is made of, read cheaply enough to export: resident set size, the C
heap as glibc's malloc sees it, and, when the process runs under `tracemalloc`
(`PYTHONTRACEMALLOC=1`), where Python allocated what it holds.

The split tells growth apart: RSS that rises while the heap's in-use bytes stay flat is memory
the allocator keeps (free chunks it does not give back); in-use bytes that rise are objects
someone holds (a cache, a leak); Python's share of them is what tracemalloc sees.
"""

from __future__ import annotations

import ctypes
import os
import time
import tracemalloc

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (0 if it is gone or /proc cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


class _Mallinfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33)
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


class CHeap:
    """glibc's malloc statistics and trim; `available` is False elsewhere (musl, macOS), where
    every method returns None / does nothing."""

    def __init__(self):
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library's among them
        self._mallinfo2 = getattr(libc, "mallinfo2", None)
        self._trim = getattr(libc, "malloc_trim", None)
        if self._mallinfo2 is not None:
            self._mallinfo2.restype = _Mallinfo2
        if self._trim is not None:
            self._trim.argtypes = (ctypes.c_size_t,)

    @property
    def available(self) -> bool:
        return self._mallinfo2 is not None

    def stats(self) -> dict | None:
        """Bytes the heap has from the system (arenas and mmapped blocks), in use by the
        program, and free inside the heap (kept by malloc for reuse)."""
        if self._mallinfo2 is None:
            return None
        m = self._mallinfo2()
        return {
            "heap_arena_bytes": m.arena,  # from brk/mmap'd arenas, all arenas together
            "heap_mmapped_bytes": m.hblkhd,  # blocks above the mmap threshold
            "heap_in_use_bytes": m.uordblks + m.hblkhd,
            "heap_free_bytes": m.fordblks,  # free chunks malloc keeps
        }

    def trim(self) -> None:
        """Give free pages inside the heap back to the system (malloc_trim(0))."""
        if self._trim is not None:
            self._trim(0)


def python_top(limit: int = 15) -> list[dict] | None:
    """Python's live allocations grouped by source line, largest first; None unless tracing."""
    if not tracemalloc.is_tracing():
        return None
    stats = tracemalloc.take_snapshot().statistics("lineno")
    return [
        {"where": f"{s.traceback[0].filename}:{s.traceback[0].lineno}", "bytes": s.size,
         "blocks": s.count}
        for s in stats[:limit]
    ]  # fmt: skip


class MemoryGauge:
    """A process's RSS and heap statistics, refreshed at most every `min_interval_s` (reading
    the heap walks malloc's free lists: cheap, but not per step)."""

    def __init__(self, min_interval_s: float = 1.0):
        self.heap = CHeap()
        self.min_interval_s = min_interval_s
        self._last = -float("inf")
        self._snapshot: dict = {}

    def snapshot(self) -> dict:
        now = time.monotonic()
        if now - self._last >= self.min_interval_s:
            self._last = now
            self._snapshot = {"rss_bytes": rss_bytes(), **(self.heap.stats() or {})}
        return self._snapshot


class FreeMemoryBound:
    """Keeps the C heap's free memory from staying resident past `budget_bytes`: glibc holds
    freed memory for reuse (process_tuning.py keeps it, for speed), and a server's varied
    shapes can leave it fragmented, so without a bound free chunks that never fit again would
    stay resident for ever. Every `interval_s`, between steps, while the heap holds more than
    `budget_bytes` free, `malloc_trim` gives the free pages back. (Trimmed holes still count
    as free, and reusing one makes it resident again, so the check cannot tell resident free
    memory from trimmed: it trims at every interval while free memory is over budget.) With
    the budget at twice a step's transients (engine/memory_plan.py), steps keep reusing their
    memory as before and a quiet machine's speed is unchanged; past it, what a trim costs is
    page faults on the holes reused within the next interval."""

    def __init__(self, budget_bytes: int, interval_s: float = 60.0, heap: CHeap | None = None):
        self.budget = budget_bytes
        self.interval_s = interval_s
        self.heap = heap or CHeap()
        self._next = time.monotonic() + interval_s
        self.trims = 0

    def between_steps(self) -> None:
        now = time.monotonic()
        if now < self._next or not self.heap.available:
            return
        self._next = now + self.interval_s
        if self.heap.stats()["heap_free_bytes"] > self.budget:
            self.heap.trim()
            self.trims += 1
