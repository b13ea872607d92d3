"""`mci bench floors`: a workload's bytes and FLOPs per step from the checkpoint's own layout,
over the machine's measured bandwidth and matmul rate."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from mci.bench.floors import Machine, ModelCost, Shape, floors
from mci.models.layout import DTYPE_BYTES, checkpoint_layout
from mci.tools.make_checkpoint import preset_config

SMALL = preset_config("small")
MACHINE = Machine(bandwidth_gbs=50.0, bf16_gflops=400.0, fp32_gflops=200.0)


def test_every_weight_is_counted_once():
    """Shared weights + every expert of every MoE layer + the embedding table = the whole
    checkpoint without its MTP layers."""
    cost = ModelCost.of(SMALL)
    specs = checkpoint_layout(SMALL, "BF16", include_mtp=False)
    total = sum(math.prod(s.shape) * DTYPE_BYTES[s.dtype] for s in specs)
    embedding = SMALL.vocab_size * SMALL.hidden_size * 2
    experts = cost.moe_layers * cost.experts * cost.expert_bytes
    assert cost.shared_bytes + experts + embedding == total
    assert cost.kv_bytes_per_token == SMALL.num_hidden_layers * (128 + 32) * 2


def test_a_decode_step_reads_its_routed_experts_and_every_sequences_kv():
    cost = ModelCost.of(SMALL)
    one, _ = cost.decode_step(1, 0)
    # one token: its 4 experts in each of the 7 MoE layers, ~53 MB for `small` (issue 33)
    assert one == cost.shared_bytes + 7 * 4 * cost.expert_bytes
    assert 50e6 < one < 56e6
    many, _ = cost.decode_step(256, 0)
    every_expert = cost.shared_bytes + 7 * 32 * cost.expert_bytes
    assert every_expert * 0.999 < many <= every_expert
    with_context, flops = cost.decode_step(32, 1000)
    assert with_context - cost.decode_step(32, 0)[0] == 32 * 1000 * cost.kv_bytes_per_token
    assert flops == 32 * (2 * cost.active_params() + 1000 * cost.decode_attention_flops)


def test_floors_grow_with_context_and_bound_throughput():
    cost = ModelCost.of(SMALL)
    short = floors(cost, MACHINE, Shape("a", 1, 8192, 128))
    long = floors(cost, MACHINE, Shape("b", 1, 16384, 128))
    assert long["tpot_ms"] > short["tpot_ms"] and long["ttft_ms"] > 2 * short["ttft_ms"]
    # a single stream's decode is bandwidth-bound: its bytes over the bandwidth
    step_bytes, _ = cost.decode_step(1, 8192 + 64)
    assert short["tpot_ms"] == pytest.approx(step_bytes / 50e9 * 1e3)
    batch = floors(cost, MACHINE, Shape("c", 32, 128, 128))
    assert batch["output_tok_s"] <= 32 / (batch["tpot_ms"] / 1e3)


@pytest.mark.parametrize("shape", ["x=1,2", "=1,2,3", "x=1,0,3", "x=a,2,3"])
def test_bad_shape_is_one_line_and_exit_2(shape, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "mci", "bench", "floors", "--model-path", str(tmp_path)]
        + ["--shape", shape],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "--shape" in out.stderr


def test_floors_cli_measures_the_machine(checkpoint):
    path = checkpoint()
    out = subprocess.run(
        [sys.executable, "-m", "mci", "bench", "floors", "--model-path", str(path), "--json"]
        + ["--shape", "single=1,32,256", "--shape", "batch=32,128,128"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["machine"]["bandwidth_gbs"] > 0.1 and got["machine"]["fp32_gflops"] > 0.1
    assert set(got["floors"]) == {"single", "batch"}
    for f in got["floors"].values():
        assert f["ttft_ms"] > 0 and f["tpot_ms"] > 0 and f["output_tok_s"] > 0
