"""`keep_freed_memory`: freed activations are reused instead of coming back as fresh pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mci.process_tuning import ENGINE_SPIN_COUNT, THP_ENABLED, engine_environment

# Allocations of growing size, each touched then freed, as a forward pass's activations grow
# with a step's token count. glibc by default maps each one that exceeds its adaptive
# threshold afresh (every page faults on first touch) and unmaps it when freed; with the
# threshold fixed and trimming off, freed memory is reused and only the growth faults.
CHURN = """
import resource, sys, torch
from mci.process_tuning import keep_freed_memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

if sys.argv[1] == "kept" and not keep_freed_memory():
    sys.exit(3)
before = faults()
for mb in range(1, 25):
    for _ in range(3):
        torch.empty(mb << 20, dtype=torch.uint8).fill_(1)
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=120
    )
    if out.returncode == 3:
        pytest.skip("the C library is not glibc")
    if out.returncode != 0:
        raise AssertionError(out.stderr)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_reused():
    default, kept = _faults("default"), _faults("kept")
    assert kept * 3 < default, (default, kept)


# A 16 MB tensor asked onto 2 MB pages before its first write: the bytes asked for, and the
# huge pages Linux then maps under it (smaps of the mappings that hold it).
HUGE = """
import torch
from mci.process_tuning import huge_pages

t = torch.empty(16 << 20, dtype=torch.uint8)
asked = huge_pages([t, t[1:]])  # one storage, asked for once
t.fill_(7)
start, end = t.data_ptr(), t.data_ptr() + t.numel()
huge, inside = 0, False
for line in open("/proc/self/smaps"):  # the advised range is a mapping of its own
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo < end and start < hi
    elif inside and head == "AnonHugePages:":
        huge += int(line.split()[1]) << 10
print(asked, huge, int(t.sum()) == 7 * (16 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
def test_weights_are_asked_onto_huge_pages_before_their_first_write():
    try:
        with open(THP_ENABLED) as f:
            mode = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    out = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(out.stderr)
    asked, huge, intact = out.stdout.split()
    assert 12 << 20 <= int(asked) <= 16 << 20, asked  # whole 2 MB pages inside the storage
    assert int(huge) >= 8 << 20, (asked, huge)  # Linux may leave some pages small
    assert intact == "True"


def _child_env(name: str) -> str:
    """`name` in the environment of a child process started now."""
    code = f"import os; print(os.environ.get({name!r}, '-'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout


def test_an_engine_process_starts_with_a_short_spin_count_and_the_caller_keeps_its_own(
    monkeypatch,
):
    """Inside `engine_environment` a started process gets GOMP_SPINCOUNT; after it, neither
    this process nor later children have it."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with engine_environment() as added:
        assert added == {"GOMP_SPINCOUNT": ENGINE_SPIN_COUNT}
        assert _child_env("GOMP_SPINCOUNT").strip() == ENGINE_SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in os.environ
    assert _child_env("GOMP_SPINCOUNT").strip() == "-"


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "7"), ("OMP_WAIT_POLICY", "active")])
def test_a_users_own_openmp_wait_setting_wins(monkeypatch, name, value):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv(name, value)
    with engine_environment() as added:
        assert added == {}
        assert _child_env("GOMP_SPINCOUNT").strip() == (value if name == "GOMP_SPINCOUNT" else "-")
    assert os.environ[name] == value
