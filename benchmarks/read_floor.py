"""How fast this machine can read one decode step's weights, in the step's own pattern.

`mci bench floors` divides a step's bytes by the rate of one 256 MB sum. A batch-1 decode step
cannot read that way: it reads ~60 weights of 0.03-8 MB one after another, each split over
the threads, and each matmul needs the previous one's output. This script reads exactly the
weights a one-token step of the checkpoint reads (from its tensor layout: every weight but the
embedding table and the MTP layer, and `num_experts_per_tok` routed experts per MoE layer,
drawn anew each step from all of them, as routing does), in layer order, with read_floor.c's
loads and nothing else, sequenced three ways:

* per call: one OpenMP parallel region per weight (one kernel call each, as mci runs today);
* one region, barriers: the threads stay up for the whole step and wait for each other after
  each weight (the best a step with its dependencies can do);
* one region, no barrier: the bandwidth floor of these reads in this order.

Norm weights (under 4 KB each) are left out: they are in cache by the time they are read.
The three are alternated in blocks of steps, so the machine's drift falls on all alike.

    python benchmarks/read_floor.py --model benchmarks/.peers/small-bf16 [--steps 200 --rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from mci.bench.floors import measure_machine
from mci.kernels.build import FLAGS
from mci.model_config import load_config
from mci.models.layout import DTYPE_BYTES, checkpoint_layout

EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.")
MODES = {0: "per call", 1: "one region, barriers", 2: "one region, no barrier"}
SMALL = 4096  # bytes: norm weights and the like, left out


def build() -> ctypes.CDLL:
    """read_floor.c compiled with the kernels' AVX2 flags (loaded, the file can go)."""
    source = Path(__file__).with_name("read_floor.c")
    flags = [f for f in FLAGS["avx2"] if f != "-Wno-psabi"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "read_floor.so"
        compiler = os.environ.get("CC", "cc")
        subprocess.run([compiler, *flags, "-o", str(out), str(source)], check=True)
        lib = ctypes.CDLL(str(out))
    lib.read_step.restype = ctypes.c_int64
    lib.read_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    return lib


def step_weights(model: Path) -> tuple[list, dict, int]:
    """(the step's weights in layer order, with a routed-expert slot as (layer, tensor name
    suffix)), {layer: {expert: {suffix: buffer}}}, experts read per MoE layer."""
    cfg = load_config(model)
    order: list = []
    experts: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for spec in checkpoint_layout(cfg, include_mtp=False):
        size = DTYPE_BYTES[spec.dtype] * int(np.prod(spec.shape))
        if spec.name.startswith("model.embed_tokens") or size < SMALL:
            continue
        buffer = np.ones(size, dtype=np.uint8)  # written, so every page is backed
        found = EXPERT.match(spec.name)
        if found is None:
            order.append(buffer)
            continue
        layer, expert = found.group(1), int(found.group(2))
        suffix = spec.name[found.end() :]
        if not experts.get(layer):
            order.append((layer, None))  # the layer's routed experts are read here
        experts.setdefault(layer, {}).setdefault(expert, {})[suffix] = buffer
    return order, experts, cfg.num_experts_per_tok


def draw_steps(order, experts, k: int, count: int, rng: random.Random) -> list[tuple]:
    """`count` steps' (pointer array, size array, number of buffers, bytes)."""
    steps = []
    for _ in range(count):
        buffers: list[np.ndarray] = []
        for item in order:
            if isinstance(item, np.ndarray):
                buffers.append(item)
                continue
            for expert in rng.sample(sorted(experts[item[0]]), k):
                buffers.extend(experts[item[0]][expert].values())
        pointers = (ctypes.c_void_p * len(buffers))(*(b.ctypes.data for b in buffers))
        sizes = (ctypes.c_long * len(buffers))(*(b.size for b in buffers))
        steps.append((pointers, sizes, len(buffers), sum(b.size for b in buffers)))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("benchmarks/.peers/small-bf16"))
    parser.add_argument("--steps", type=int, default=200, help="steps per block")
    parser.add_argument("--rounds", type=int, default=5, help="blocks of each mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lib = build()
    order, experts, k = step_weights(args.model)
    steps = draw_steps(order, experts, k, args.steps, random.Random(args.seed))
    times: dict[int, list[float]] = {mode: [] for mode in MODES}
    for pointers, sizes, n, _ in steps[:20]:  # warm-up
        lib.read_step(pointers, sizes, n, 0)
    for _ in range(args.rounds):
        for mode in MODES:
            for pointers, sizes, n, _ in steps:
                start = time.perf_counter()
                lib.read_step(pointers, sizes, n, mode)
                times[mode].append(time.perf_counter() - start)
    mean_bytes = statistics.fmean(s[3] for s in steps)
    machine = measure_machine()
    print(
        f"{args.model.name}: {steps[0][2]} weights, {mean_bytes / 1e6:.1f} MB per one-token "
        f"step; {args.rounds} x {args.steps} steps per mode, alternated"
    )
    print(
        f"256 MB sum (mci bench floors): {machine.bandwidth_gbs:.1f} GB/s -> "
        f"{mean_bytes / machine.bandwidth_gbs / 1e6:.2f} ms per step"
    )
    for mode, label in MODES.items():
        median = statistics.median(times[mode])
        p10 = statistics.quantiles(times[mode], n=10)[0]
        print(
            f"{label:>24}: median {median * 1e3:.2f} ms ({mean_bytes / median / 1e9:.1f} GB/s), "
            f"p10 {p10 * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
