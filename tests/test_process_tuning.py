"""`keep_freed_memory`: freed activations are reused instead of coming back as fresh pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
