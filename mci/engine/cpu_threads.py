"""How many threads the engine computes with on the CPU: as many CPUs as it can get now.

Why: a step is ~100 parallel regions (the kernels', oneDNN's), and each ends when its slowest
thread does. With a neighbour taking one of two cores (a busy loop, another service, the
front end streaming, a CPU quota), one thread of two is preempted for a whole scheduler slice
at a time while the other waits for it at every region: measured on the `small` model, single
-stream decode went from 2.1 to 11 ms/token in process with two threads (226 ms served, where
the front end is a third contender), and to 3.9 with one thread. Under a 1.5-CPU quota, two
threads ran out of quota and were throttled (3.6-3.9 ms/token) where one thread was not
(2.9). So the engine computes with as many threads as it has whole CPUs free.

What it reads, every `interval_s` (0.5 s), between steps and while idle (so never inside a
step):

* `available`: the CPUs this process may run on (its affinity) and its CPU quota (cgroup v2
  `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, the tightest along its path);
* `others`: how much of those CPUs other work wanted over the window, in CPUs: their busy
  time (/proc/stat's per-CPU lines; steal included, a hypervisor's other guests) minus this
  process's own CPU time, plus the time this process's threads waited, runnable, for a CPU
  (/proc/self/task/*/schedstat): while two engine threads share two CPUs with a busy loop,
  each side gets only part of a CPU, and what the engine lost shows as its threads' wait.

    target = floor(available) - floor(others / TAKEN), clamped to [1, max_threads],
             then rounded down to one of `thread_levels(max_threads)`

Why levels: oneDNN compiles a kernel per matmul shape *and thread count* (~0.55 MB of JIT
code each; measured in docs/reliability.md), so every count the governor may pick is a full
set of kernels. Five counts at most (max, 3/4, 1/2, 1/4 of it, 1) bound that memory, and the
engine compiles every level's set at start (engine/builder.py), so none lands mid-traffic.

Fewer threads only when `lower_after` windows in a row ask for them, and more only when
`raise_after` windows in a row do, so a short burst of other work does not make the count
flap: a thread taken away for a burst stays away for at least `raise_after` windows more.
A neighbour that holds a CPU asks in every window, so it gets its CPU one window
(0.5 s) later than at once.

Windows in which the engine ran no step never take a thread away: an idle engine loses nothing
by keeping its threads, and what such a window sees is other work alone, which may be a burst
that ends before any request arrives (measured: a benchmark client starting up, ~1 CPU for
1-2 s, took a thread from an idle engine right before its batch came, and the batch's ~1 s
prefill and first decode steps ran on one thread: TTFT p50 1.3-1.7 s against 1.0-1.1 s with
the threads fixed at two). Once steps run, a neighbour that stays shows in their windows. Idle
windows may still give threads back.

Invariant it relies on (tests/test_cpu_threads.py): the thread count never changes a result.
The kernels' sums run in the same order whatever the thread count (cpu_matvec.c), and the
oneDNN and aten paths were measured equal too, so this changes speed only.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mci")

INTERVAL_S = 0.5  # how often the CPUs are read: ~50 us a read, against a ~2 ms step
RAISE_AFTER = 2  # windows in a row that must ask for more threads before they are added
LOWER_AFTER = 2  # windows in a row that must ask for fewer threads before they are taken
# A CPU counts as taken when other work keeps it this busy. The front end and the clients
# beside a served engine come in bursts between steps (measured: 0.5-1.0 CPU of them on a
# 32-request batch), and taking a thread away for them lost throughput (one run: 643 against
# 814 tok/s on FP8); a neighbour that holds a CPU keeps it busy all the time.
TAKEN = 0.8


@dataclass(frozen=True)
class CpuReading:
    """One reading of the CPUs this process may use."""

    wall: float  # monotonic seconds
    busy: float  # CPU-seconds those CPUs have spent busy since boot (every process)
    own: float  # CPU-seconds this process has used
    waited: float  # seconds this process's threads have waited, runnable, for a CPU
    available: float  # CPUs this process may use now (affinity and quota)


def thread_levels(max_threads: int) -> tuple[int, ...]:
    """The thread counts the governor may choose, largest first: max_threads, 3/4, 1/2 and
    1/4 of it, and 1 (2 CPUs: 2 and 1)."""
    counts = {max_threads, max_threads * 3 // 4, max_threads // 2, max_threads // 4, 1}
    return tuple(sorted((c for c in counts if c >= 1), reverse=True))


def target_threads(available: float, others: float, max_threads: int) -> int:
    """Threads for `available` CPUs (a fractional quota counts its whole CPUs: a thread for
    the fraction is throttled every period) of which `others` CPUs are wanted by other work
    (each `TAKEN` takes one), rounded down to a level."""
    free = math.floor(available + 1e-9) - math.floor(others / TAKEN + 1e-9)
    free = max(1, min(max_threads, free))
    return next(level for level in thread_levels(max_threads) if level <= free)


def quota_files(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> list[tuple[Path, ...]]:
    """The CPU quota files along this process's cgroup path (`membership` lists its cgroups):
    (cpu.max,) for cgroup v2, (cpu.cfs_quota_us, cpu.cfs_period_us) for v1, this cgroup's
    and each parent's that exist."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2
            base, names = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            base, names = root / controllers, ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            if not base.exists():
                base = root / "cpu"
        else:
            continue
        parts = Path(path.lstrip("/")).parts
        for depth in range(len(parts), -1, -1):  # this cgroup, then each parent
            files = tuple(base.joinpath(*parts[:depth], name) for name in names)
            if all(f.exists() for f in files):
                found.append(files)
    return found


def cgroup_quota(files: list[tuple[Path, ...]]) -> float | None:
    """CPUs the tightest of these quotas allows ("max 100000" / "150000 100000" for v2; -1 or
    a quota and a period for v1), or None without one."""
    limits = []
    for group in files:
        try:
            values = " ".join(f.read_text() for f in group).split()
            if len(values) == 2 and values[0] not in ("max", "-1") and float(values[1]) > 0:
                limits.append(float(values[0]) / float(values[1]))
        except (OSError, ValueError):
            continue
    return min(limits) if limits else None


class ProcCpuReader:
    """Readings from /proc and the cgroup files (Linux). The CPUs are this process's affinity
    when it starts; `read` gives None where /proc/stat does not list them (another OS, or a
    container whose /proc/stat numbers its CPUs apart from the host's)."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.cpus = os.sched_getaffinity(0)
        self.quota = quota_files()

    def read(self) -> CpuReading | None:
        try:
            lines = Path("/proc/stat").read_text().splitlines()
        except OSError:
            return None
        busy, seen = 0, 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if (
                not name.startswith("cpu")
                or not name[3:].isdigit()
                or int(name[3:]) not in self.cpus
            ):
                continue
            # user nice system idle iowait irq softirq steal (guest time is inside user)
            ticks = [int(v) for v in rest.split()[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]
            seen += 1
        if seen != len(self.cpus):
            return None
        times = os.times()
        quota = cgroup_quota(self.quota)
        cpus = float(len(self.cpus))
        return CpuReading(
            wall=time.monotonic(),
            busy=busy / self.hz,
            own=times.user + times.system,
            waited=_threads_waited(),
            available=cpus if quota is None else min(cpus, quota),
        )


def _threads_waited() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU (the second
    field of each thread's schedstat, in ns), 0 where the kernel does not report it."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


class ThreadGovernor:
    """Sets the process's compute threads (torch's and the kernels' OpenMP pool) to what the
    CPUs allow, between steps; see the module docstring. Never raises: a reading that fails
    turns it off (the count then stays as it is)."""

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        reader: ProcCpuReader | None = None,
        interval_s: float = INTERVAL_S,
        raise_after: int = RAISE_AFTER,
        lower_after: int = LOWER_AFTER,
    ):
        self.max_threads = max_threads
        self.threads = max_threads  # what the process computes with now
        self._set = set_threads
        self._interval = interval_s
        self._after = {True: raise_after, False: lower_after}  # by "asked for more"
        self._asks = 0  # windows in a row that asked for a change the same way
        self._asked_more: bool | None = None  # which way they asked
        self._stepped = False  # the engine ran a step in the window being measured
        self.changes = 0
        self._last: CpuReading | None = None
        try:
            self._reader = reader or ProcCpuReader()
            self._last = self._reader.read()
        except Exception:  # noqa: BLE001 - no readings: the count stays fixed
            log.exception("reading the CPUs failed; compute threads stay at %d", max_threads)
        if self._last is None:
            log.info("no CPU readings here; compute threads stay at %d", max_threads)

    def between_steps(self, stepping: bool = True) -> None:
        """Read the CPUs when a window has passed, and change the thread count if they ask;
        `stepping`: a step runs next (False: called while the engine is idle). That step
        belongs to the next window."""
        if self._last is None:
            return
        if time.monotonic() - self._last.wall >= self._interval:
            try:
                self._adjust()
            except Exception:  # noqa: BLE001 - never the step's failure
                log.exception("reading the CPUs failed; compute threads stay at %d", self.threads)
                self._last = None
        self._stepped = self._stepped or stepping

    def _adjust(self) -> None:
        now = self._reader.read()
        if now is None:
            log.info("CPU readings stopped; compute threads stay at %d", self.threads)
            self._last = None
            return
        last, self._last = self._last, now
        wall = now.wall - last.wall
        # what other work got of these CPUs, plus what this process wanted and did not get
        # (while its threads compete with a neighbour, each side gets only part of a CPU)
        others = max(0.0, (now.busy - last.busy) - (now.own - last.own)) / wall
        others += max(0.0, now.waited - last.waited) / wall
        target = target_threads(now.available, others, self.max_threads)
        stepped, self._stepped = self._stepped, False
        if target < self.threads and not stepped:
            target = self.threads  # an idle window lowers nothing (see the module docstring)
        if target == self.threads:
            self._asks, self._asked_more = 0, None
            return
        more = target > self.threads
        self._asks = self._asks + 1 if more == self._asked_more else 1
        self._asked_more = more
        if self._asks < self._after[more]:
            return
        self._asks, self._asked_more = 0, None
        log.info(
            "compute threads %d -> %d: %.1f of %.1f CPUs wanted by other work",
            self.threads,
            target,
            others,
            now.available,
        )
        self.threads = target
        self.changes += 1
        self._set(target)
