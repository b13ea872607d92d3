"""The engine's compute threads follow the CPUs it can get (mci/engine/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import prefill_logits, stepwise_logits

from mci.engine.config import ModelPlacement
from mci.engine.cpu_threads import (
    CpuReading,
    ThreadGovernor,
    cgroup_quota,
    quota_files,
    target_threads,
    thread_levels,
)
from mci.errors import UserError
from mci.models.loader import load_model


@pytest.mark.parametrize(
    ("available", "others", "max_threads", "threads"),
    [
        (2, 0.0, 2, 2),
        (2, 0.6, 2, 2),  # a front end's bursts do not take a CPU
        (2, 1.0, 2, 1),  # a busy neighbour does
        (2, 1.6, 2, 1),  # never fewer than one
        (1.5, 0.0, 2, 1),  # a 1.5-CPU quota: one whole CPU
        (16, 3.3, 16, 12),
        (16, 2.0, 16, 12),  # 14 free: the level below (oneDNN kernels per count)
        (16, 9.0, 16, 4),
        (64, 0.0, 8, 8),  # at most max_threads
    ],
)
def test_target_threads(available, others, max_threads, threads):
    assert target_threads(available, others, max_threads) == threads


@pytest.mark.parametrize(
    ("max_threads", "levels"),
    [(1, (1,)), (2, (2, 1)), (3, (3, 2, 1)), (8, (8, 6, 4, 2, 1)), (64, (64, 48, 32, 16, 1))],
)
def test_thread_levels(max_threads, levels):
    assert thread_levels(max_threads) == levels


class FakeReader:
    """Readings the test scripts: each `advance` adds wall time, other work and own work."""

    def __init__(self, available=2.0):
        self.now = CpuReading(time.monotonic(), 0.0, 0.0, 0.0, available)

    def advance(self, seconds: float, others: float, own: float = 1.0, waited=0.0) -> None:
        r = self.now
        self.now = CpuReading(
            r.wall + seconds,
            r.busy + (others + own) * seconds,
            r.own + own * seconds,
            r.waited + waited * seconds,
            r.available,
        )

    def read(self) -> CpuReading:
        return self.now


def test_governor_lowers_and_raises_after_two_windows_and_never_lowers_while_idle(monkeypatch):
    reader, calls = FakeReader(), []
    clock = [reader.now.wall]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    gov = ThreadGovernor(2, calls.append, reader, interval_s=0.5, raise_after=2, lower_after=2)

    def window(others: float, waited: float = 0.0, stepping: bool = True) -> int:
        gov.between_steps(stepping)  # inside the window: nothing is read
        reader.advance(0.5, others, waited=waited)
        clock[0] = reader.now.wall
        gov.between_steps(stepping)
        return gov.threads

    assert window(0.2) == 2 and calls == []
    # a client starting up beside an idle engine: idle windows take no thread
    assert window(1.0, stepping=False) == 2
    assert window(1.0, stepping=False) == 2 and calls == []
    assert window(1.0) == 2  # one busy window is a burst
    assert window(0.0) == 2
    assert window(1.0) == 2
    assert window(1.0) == 1 and calls == [1]  # a busy neighbour: two windows in a row
    assert window(0.0) == 1  # one quiet window is not enough
    assert window(1.0) == 1
    assert window(0.0) == 1
    assert window(0.0, stepping=False) == 2 and calls == [1, 2]  # idle windows give back
    # competing with our two threads the neighbour gets 0.6 of a CPU; our threads' wait
    # shows what it took from them
    assert window(0.6, waited=0.4) == 2
    assert window(0.6, waited=0.4) == 1 and calls == [1, 2, 1]
    clock[0] += 0.1  # inside a window: nothing is read
    gov.between_steps()
    assert gov.changes == 3


def test_a_failing_reading_turns_the_governor_off(monkeypatch):
    reader, calls = FakeReader(), []
    gov = ThreadGovernor(2, calls.append, reader, interval_s=0.0)

    def broken():
        raise OSError("gone")

    monkeypatch.setattr(reader, "read", broken)
    gov.between_steps()  # logged, not raised
    gov.between_steps()
    assert gov.threads == 2 and calls == []


def test_cgroup_quota_v1_and_v2(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "box" / "job").mkdir(parents=True)
    (v2 / "box" / "cpu.max").write_text("150000 100000\n")
    (v2 / "box" / "job" / "cpu.max").write_text("max 100000\n")
    member = tmp_path / "cgroup"
    member.write_text("0::/box/job\nnonsense\n")
    assert cgroup_quota(quota_files(v2, member)) == 1.5  # the parent's quota binds
    v1 = tmp_path / "v1"
    (v1 / "cpu" / "svc").mkdir(parents=True)
    (v1 / "cpu" / "svc" / "cpu.cfs_quota_us").write_text("250000")
    (v1 / "cpu" / "svc" / "cpu.cfs_period_us").write_text("100000")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    member.write_text("4:memory:/x\n2:cpu:/svc\n")
    assert cgroup_quota(quota_files(v1, member)) == 2.5
    member.write_text("2:cpu:/\n")
    assert cgroup_quota(quota_files(v1, member)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("")  # unreadable values are no quota
    assert cgroup_quota(quota_files(v1, member)) is None


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_cpu_threads_flag_is_checked(value):
    with pytest.raises(UserError, match="--cpu-threads"):
        ModelPlacement(cpu_threads=value)
    assert ModelPlacement(cpu_threads="3").cpu_threads == "3"


@pytest.mark.parametrize("fp8", [False, True])
def test_results_do_not_depend_on_the_thread_count(checkpoint, fp8):
    """What the governor relies on: changing the count changes speed only."""
    model = load_model(checkpoint(dtype="bfloat16", fp8=fp8), "bfloat16")
    model.pack_for_cpu()
    ids = torch.randint(0, 2048, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            runs.append((prefill_logits(model, ids), stepwise_logits(model, ids[:24], "auto", 9)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_busy_neighbour_takes_a_thread_away_and_leaving_gives_it_back():
    """Contention smoke test with the real readings: a busy loop pinned to one of this
    process's CPUs makes the governor drop a thread; when it ends, the thread comes back."""
    cpus = sorted(os.sched_getaffinity(0))
    calls = []
    gov = ThreadGovernor(len(cpus), calls.append, interval_s=0.3, raise_after=2)
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpus[-1]}}})\nwhile 1: pass"]
    )
    try:
        deadline = time.monotonic() + 10
        while gov.threads == len(cpus) and time.monotonic() < deadline:
            time.sleep(0.05)
            gov.between_steps()
        assert gov.threads < len(cpus), "the busy loop was not noticed"
    finally:
        busy.kill()
        busy.wait()
    deadline = time.monotonic() + 10
    while gov.threads < len(cpus) and time.monotonic() < deadline:
        time.sleep(0.05)
        gov.between_steps()
    assert gov.threads == len(cpus) and calls[-1] == len(cpus)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_mci_serve_gives_a_busy_neighbour_its_cpu_and_answers_the_same(checkpoint):
    """Through `mci serve`: the engine's threads (in /internal/state and /metrics) drop while
    a busy loop holds a CPU, come back after, and the answers are the same either way."""
    import httpx
    from server_helpers import LiveServer

    cpus = sorted(os.sched_getaffinity(0))
    body = {"model": "x", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0}

    def wait_threads(server, want, timeout_s=15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while server.state()["cpu_threads"] != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.state()["cpu_threads"] == want

    path = checkpoint(dtype="bfloat16")
    with LiveServer(path, "--served-model-name", "x", dtype="bfloat16") as server:
        wait_threads(server, len(cpus))
        quiet = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        busy = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os; os.sched_setaffinity(0, {{{cpus[-1]}}})\nwhile 1: pass",
            ]
        )
        stop = threading.Event()

        def keep_stepping() -> None:  # an idle engine keeps its threads; a busy one gives
            while not stop.is_set():
                httpx.post(
                    server.url + "/v1/completions",
                    json={**body, "max_tokens": 64, "ignore_eos": True},
                    timeout=60,
                )

        load = threading.Thread(target=keep_stepping)
        load.start()
        try:
            wait_threads(server, len(cpus) - 1)
            gauge = f"mci:cpu_threads {len(cpus) - 1:.1f}"  # from the engine's next heartbeat
            deadline = time.monotonic() + 10
            while gauge not in httpx.get(server.url + "/metrics", timeout=10).text:
                assert time.monotonic() < deadline, "mci:cpu_threads did not follow"
                time.sleep(0.2)
            loaded = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        finally:
            busy.kill()
            busy.wait()
            stop.set()
            load.join()
        wait_threads(server, len(cpus))
    assert loaded["choices"][0]["text"] == quiet["choices"][0]["text"]
