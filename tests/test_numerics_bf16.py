"""bf16 numerics: mci's token logprobs drift from transformers' fp32 no more than transformers'
own bf16 does (issue 8), on the bundled model and held-out text, along the paths the engine
takes: a fresh prompt's prefill (auto: expanded here) and decode (auto: absorbed).

The measurement is scripts/numerics_bf16.py's (which also covers the forced paths and chunked
prefill over ~3000 positions); this runs it on its first ~1000 positions.

The largest deltas come from MoE routing near-ties that any rounding can flip (one flip has
moved a logprob by 2.7 nats on 9180 positions), so `max` depends on which near-ties each
implementation happens to flip; mci flips about half as many as transformers bf16, which the
`flips` check pins down. If `max` alone fails after a change, look at the flips first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import needs_bf16_matmuls

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "numerics_bf16.py"
NUM_POSITIONS = 1020  # four 256-token windows, one from each of the first held-out files
MODES = ("prefill-auto", "decode")


def _numerics():
    spec = importlib.util.spec_from_file_location("numerics_bf16", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stats():
    pytest.importorskip("transformers")
    nb = _numerics()
    seqs = nb.held_out_sequences(nb.DEFAULT_MODEL, NUM_POSITIONS, seq_len=256)
    assert sum(len(s) - 1 for s in seqs) >= 1000
    return nb.measure(nb.DEFAULT_MODEL, seqs, modes=MODES, with_fp32=False)


# measured with oneDNN's bf16 matmuls; without them (torch's own kernels, on an AMD EPYC
# without AVX-512) p50 and p95 stayed better than transformers' but the max did not
@needs_bf16_matmuls
@pytest.mark.parametrize("mode", MODES)
def test_bf16_logprob_drift_no_worse_than_transformers(stats, mode):
    ours, theirs = stats[f"mci-bf16 {mode}"], stats["hf-bf16"]
    summary = f"mci {ours} vs transformers bf16 {theirs}"
    assert ours["p95"] <= theirs["p95"], summary
    assert ours["max"] <= theirs["max"], summary
    assert ours["flips"] <= theirs["flips"], summary
