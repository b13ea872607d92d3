"""Tuning a serving process for a long life of the same work: two settings, each measured.

1. Keep freed memory in the process on the CPU, so a step's tensors do not page-fault
   (`keep_freed_memory`, at engine build). glibc's malloc hands allocations above its mmap
   threshold (dynamic, from 128 KB) straight to the kernel and unmaps them when freed, and
   trims the heap's free top back to the kernel. A forward pass allocates and frees the same
   few-MB activations every layer, so each one comes back as fresh pages that fault on first
   touch: measured on the `small` model's 256-token prefill, converting the experts' [1024,
   512] output to float32 took 0.54 ms in the engine against 0.07 ms in a loop that reuses its
   memory, and 0.12 ms with these settings. Fixing the mmap threshold (up to glibc's 32 MB cap
   on 64-bit) and never trimming makes freed activations reusable: the process keeps its
   high-water mark instead of returning it between steps, which is what a server that runs
   the same step shapes all day wants.

2. Keep Python's cyclic garbage collector off the objects a process made while starting up
   (`freeze_startup_objects`, once a server process is ready). A serving process starts with
   about a million long-lived objects (torch, transformers' tokenizer, pydantic's schemas,
   FastAPI's routes). The collector's oldest generation walks all of them whenever it runs,
   and the first burst of requests triggers it: measured on the front end, a first burst of
   32 concurrent requests cost 140-160 ms of CPU against 40 ms for the next one, on a 2-core
   machine where every such millisecond is taken from the engine's step. Frozen objects are
   never scanned again (`gc.freeze`, as CPython's documentation suggests for a process that
   forks or serves after a long start-up); the collector still runs for objects made later.

3. Back the weights with 2 MB pages (`huge_pages`, on the fresh parameters, before the
   checkpoint is copied in). A decode step streams every active weight from memory, and on
   4 KB pages each 4 KB of it costs a TLB miss and a page walk, and the hardware prefetchers
   stop at each page's end. Linux gives anonymous memory huge pages only where asked
   (transparent_hugepage=madvise is the common default; it was here): `MADV_HUGEPAGE` on
   memory not yet touched makes its first touch map 2 MB pages. Measured on a 2-core Zen 4
   EPYC: a 256 MB bf16 weight streamed cold by the skinny kernels, 4 KB against 2 MB pages
   alternating in one process, 22.9 -> 24.7 GB/s at one row of x, 16.1 -> 17.2 at 4, 10.1 ->
   11.5 at 8; the `small` model's batch-1 decode step, two engines alternating in one
   process, median 3.99 -> 3.81 and 4.57 -> 3.96 ms in two runs (14 of 18 rounds faster), its
   32-request step level (24.8 against 25.2 ms). The cost is start-up: loading `small` took a
   median 0.26 s against 0.14 s on 4 KB pages (4 loads each, alternating), the huge pages'
   faults being dearer. Moving memory already touched (`MADV_COLLAPSE`) copies it: 13 s for
   4 GB here, too slow for a start-up.

4. Let the engine process's OpenMP threads sleep sooner when idle (`engine_environment`, around
   the engine process's start). libgomp's threads spin for GOMP_SPINCOUNT rounds (a load and a
   `pause`, the `pause` alone ~11 ns on the Intel Xeon measured) before they sleep between
   parallel regions: 300,000 by default, ~3.3 ms there. So a decoding engine's second thread
   never sleeps: while the first runs the step's Python and writes its outputs (~0.2 ms), it
   spins, and the front end woken by those outputs (and the client it streams to) must take a CPU
   from one of the two engine threads. At 3,000 rounds (~35 us there) the spinning thread sleeps
   in that gap, its CPU is idle, and the front end runs there; the step's first region pays one
   wake-up. Measured on `small`, served single streams of 256 tokens (a server per setting in
   turn, 8 streams each, mean ITL per server): default 1.68 and 1.71 ms, 3,000 rounds 1.55 and
   1.55, 10,000 1.61 and 1.59, 1,000 1.69 and 1.66 (~11 us: threads that sleep inside a step's
   short gaps too). A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
from collections.abc import Iterator

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc refuses more on 64-bit
NEVER_TRIM = 2**31 - 1  # mallopt takes an int
MADV_HUGEPAGE = 14  # madvise advice, from Linux's mman-common.h
HUGE_PAGE = 2 * 1024 * 1024
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
ENGINE_SPIN_COUNT = "3000"  # libgomp's spins before an idle thread sleeps (4. above)


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above; False where the C library is not glibc (nothing done)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
    )


def freeze_startup_objects() -> None:
    """Call once, when start-up is done: collect what start-up left, then exclude the
    survivors from every later collection."""
    gc.collect()
    gc.freeze()


def huge_pages(tensors) -> int:
    """Ask Linux for 2 MB pages under the CPU tensors' memory, before it is first written; the
    bytes asked for. Only whole huge pages inside a storage are asked for (a storage under 2
    MB, or the edges of a larger one, stay as they are); each storage once. Memory already
    touched keeps its pages. Where transparent huge pages are off (`never`) or the kernel has
    none, nothing is asked and the count is 0: a speed-up, never a requirement."""
    try:
        with open(THP_ENABLED) as f:
            if "[never]" in f.read():
                return 0
    except OSError:  # no such file: a kernel without transparent huge pages
        return 0
    name = ctypes.util.find_library("c")
    madvise = getattr(ctypes.CDLL(name, use_errno=True), "madvise", None) if name else None
    if madvise is None:
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    asked, seen = 0, set()
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start in seen:
            continue
        seen.add(start)
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if hi > lo and madvise(lo, hi - lo, MADV_HUGEPAGE) == 0:
            asked += hi - lo
    return asked


@contextlib.contextmanager
def engine_environment() -> Iterator[dict[str, str]]:
    """Environment variables set while an engine process starts (its libgomp reads them when
    it loads), then put back: GOMP_SPINCOUNT (4. above), unless the user set it or
    OMP_WAIT_POLICY. Yields what it set. The process's own environment holds them meanwhile:
    a child another thread starts in that window (a restart runs on the supervisor's thread
    while the server serves) inherits them too, which for OpenMP's spin count is harmless.
    Followers of a multi-node run (`--node-rank` above 0) start without it."""
    added = {}
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        added["GOMP_SPINCOUNT"] = ENGINE_SPIN_COUNT
    os.environ.update(added)
    try:
        yield added
    finally:
        for key in added:
            os.environ.pop(key, None)
