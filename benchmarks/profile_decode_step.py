#!/usr/bin/env python3
"""Where a decode step's time goes: 1 and 32 requests decoding on the `small` checkpoint.

Builds the engine core the server runs (no HTTP), lets every request reach steady decode, then
times `--steps` steps phase by phase: the scheduler's work before the forward (`schedule`),
the batch's tensors (`metadata`), the model's forward (`forward`: every layer, with the KV
writes and attention), the LM head on the sampled rows (`logits`), the sampler (`sample`),
the scheduler's bookkeeping after it (`update`: outputs, detokenisation, stop checks), and
what is left of the step (`other`). Then torch's profiler over a few steps: the operators that
take the most time, so a kernel's share of the forward is visible. Against the step: the
machine floor of the same step (`mci bench floors`).

    python benchmarks/profile_decode_step.py --model benchmarks/.peers/small-bf16
    python benchmarks/profile_decode_step.py --model CKPT --batch 1,32 --steps 64 --json out.json
    python benchmarks/profile_decode_step.py --model benchmarks/.peers/small-bf16-32k --batch 1 \
        --context 8192    # decode at 8k of context
    python benchmarks/profile_decode_step.py --model CKPT --device cuda   # the GPU path
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import mci.runner.model_runner as model_runner_module
from mci.bench.floors import ModelCost, floors, measure_machine
from mci.bench.floors import Shape as FloorShape
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.engine.builder import build_engine_core
from mci.engine.config import CacheConfig, EngineConfig, ModelPlacement
from mci.layers.attention_metadata import AttentionMetadata
from mci.model_config import load_config
from mci.models.loader import load_model
from mci.tokenizer import TextTokenizer


class PhaseClock:
    """Wraps callables so that each call's wall time adds to its phase."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        return timed


def build(model_path: Path, dtype: str, context: int, device: str = "cpu"):
    model = load_model(model_path, dtype, device)
    tokenizer = TextTokenizer.load(model_path)
    config = EngineConfig(
        model=ModelPlacement(model_path=model_path, dtype=dtype, device=device),
        cache=CacheConfig(max_total_tokens=max(32768, 2 * context + 4096)),
    )
    return build_engine_core(config, model, tokenizer)


def profile(core, batch: int, steps: int, top: int, context: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    vocab = core.runner.model.cfg.vocab_size
    for i in range(batch):
        prompt = torch.randint(10, vocab, (context,), generator=gen).tolist()
        params = SamplingParams(max_new_tokens=10_000, temperature=0, ignore_eos=True)
        core.add_request(Request(f"b{batch}-{i}", prompt, params))
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in core.scheduler.running) or (
        core.scheduler.waiting
    ):  # every prompt prefilled (in chunks where long), then a few decode steps
        core.step()
    for _ in range(3):
        core.step()

    clock = PhaseClock()
    sched, model = core.scheduler, core.runner.model
    originals = {
        "schedule": (sched, "schedule"),
        "update": (sched, "update"),
        "forward": (model, "forward"),
        "logits": (model, "logits"),
    }
    saved = {name: getattr(obj, attr) for name, (obj, attr) in originals.items()}
    saved_sample, saved_build = model_runner_module.sample, AttentionMetadata.build
    for name, (obj, attr) in originals.items():
        setattr(obj, attr, clock.wrap(name, saved[name]))
    model_runner_module.sample = clock.wrap("sample", saved_sample)
    AttentionMetadata.build = staticmethod(clock.wrap("metadata", saved_build))
    step_times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            step_times.append(time.perf_counter() - start)
    finally:
        for obj, attr in originals.values():
            delattr(obj, attr)  # the instance attribute set above: the class's method again
        model_runner_module.sample, AttentionMetadata.build = saved_sample, saved_build

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and core.runner.model.lm_head.weight.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)  # the kernels' own time too
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(8):
            core.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    # Python's view of the same steps: where the host's time goes between the operators
    python_profile = cProfile.Profile()
    python_profile.runcall(lambda: [core.step() for _ in range(8)])
    listing = io.StringIO()
    pstats.Stats(python_profile, stream=listing).sort_stats("tottime").print_stats(top)

    for req in list(sched.running) + list(sched.waiting):
        core.abort_request(req.request_id)
    while sched.has_work:
        core.step()

    total = sum(step_times)
    phases = {name: 1e3 * t / steps for name, t in clock.totals.items()}
    phases["other"] = 1e3 * total / steps - sum(phases.values())
    return {
        "batch": batch,
        "step_ms_mean": 1e3 * total / steps,
        "step_ms_p50": 1e3 * statistics.median(step_times),
        "phases_ms": phases,
        "torch_profile": table,
        "python_profile": listing.getvalue(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    ap.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=32, help="prompt tokens of each request")
    ap.add_argument("--top", type=int, default=15, help="operators shown from the profile")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    machine = measure_machine(device=args.device)
    cost = ModelCost.of(load_config(args.model))
    core = build(args.model, args.dtype, args.context, args.device)
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        got = profile(core, batch, args.steps, args.top, args.context)
        shape = FloorShape("step", batch, args.context + 8, 2 * args.steps)
        got["floor_ms"] = floors(cost, machine, shape)["tpot_ms"]
        results.append(got)
        phases = ", ".join(f"{k} {v:.2f}" for k, v in got["phases_ms"].items())
        print(
            f"\n== batch {batch}: step {got['step_ms_mean']:.2f} ms mean, "
            f"{got['step_ms_p50']:.2f} p50; floor {got['floor_ms']:.2f} ms\n   {phases}\n"
        )
        print(got["torch_profile"])
        print(got["python_profile"])
    if args.json:
        args.json.write_text(json.dumps({"machine": vars(machine), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
