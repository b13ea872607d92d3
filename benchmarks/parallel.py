#!/usr/bin/env python3
"""Parallel layouts on this machine: one process vs tensor parallelism (TP 2), expert
parallelism (EP 2), TP 2 + EP 2 and data-parallel attention + EP 2 (all-to-all and all-gather
token dispatch), offline on the `small` checkpoint (bf16, random weights).

Two workloads per layout: a batch (16 prompts of 128 random token ids, 64 greedy tokens each,
output tokens/s) and a single stream (32-token prompt, 128 tokens, ms per output token). On 2
CPU cores two ranks get one core each and pay gloo's loopback collectives: this measures the
communication overhead, not a speed-up. Layouts alternate within each round; medians printed.

    python benchmarks/parallel.py --rounds 3

Needs the checkpoint of benchmarks/prepare_checkpoint.sh (benchmarks/.peers/small-bf16).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from mci.cache.config import CacheConfig
from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine
from mci.parallel.config import ParallelConfig

CKPT = Path(__file__).resolve().parent / ".peers" / "small-bf16"
LAYOUTS = {
    "one process": ParallelConfig(),
    "TP 2": ParallelConfig(tp_size=2),
    "EP 2": ParallelConfig(ep_size=2),
    "TP 2 + EP 2": ParallelConfig(tp_size=2, ep_size=2),
    "DP-attention + EP 2, all-to-all": ParallelConfig(ep_size=2, enable_dp_attention=True),
    "DP-attention + EP 2, all-gather": ParallelConfig(
        ep_size=2, enable_dp_attention=True, moe_dispatch="all_gather"
    ),
}


def measure(layout: ParallelConfig, batch: list[list[int]], single: list[int]) -> tuple:
    """(batch output tokens/s, single-stream ms per token) of one engine on `layout`."""
    torch.set_num_threads(os.cpu_count() or 1)  # a parallel run before set rank 0's share
    config = EngineConfig(
        model=ModelPlacement(model_path=CKPT, dtype="bfloat16"),
        cache=CacheConfig(max_total_tokens=32768),
        parallel=layout,
    )
    engine = Engine(config, background=False)
    try:
        engine.generate([single], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
        params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        results = engine.generate(batch, params)
        tokens = sum(len(r.outputs[0].output_token_ids) for r in results)
        tps = tokens / (time.perf_counter() - t)
        one = SamplingParams(max_new_tokens=128, temperature=0, ignore_eos=True)
        t = time.perf_counter()  # the 32-token prefill is one step of the 128
        engine.generate([single], one)
        ms = 1000 * (time.perf_counter() - t) / 128
    finally:
        engine.shutdown()
    return tps, ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    batch = [[rng.randrange(100, 8000) for _ in range(128)] for _ in range(16)]
    single = [rng.randrange(100, 8000) for _ in range(32)]
    rows: dict[str, list[tuple]] = {name: [] for name in LAYOUTS}
    for _ in range(args.rounds):
        for name, layout in LAYOUTS.items():
            rows[name].append(measure(layout, batch, single))
            print(name, rows[name][-1], file=sys.stderr, flush=True)
    base_tps = statistics.median(r[0] for r in rows["one process"])
    base_ms = statistics.median(r[1] for r in rows["one process"])
    print("| layout | batch tok/s | vs one process | single ms/token | vs one process |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        tps = statistics.median(r[0] for r in runs)
        ms = statistics.median(r[1] for r in runs)
        print(f"| {name} | {tps:.0f} | {tps / base_tps:.2f}x | {ms:.1f} | {ms / base_ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
