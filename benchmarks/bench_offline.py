"""Offline engine benchmarks on the `small` checkpoint, each pair measured in one run.

1. throughput: mci.Engine on N requests (prompt P / output O tokens, EOS ignored) vs
   Hugging Face transformers `generate` with static batching (all N padded into one batch).
2. shared-prefix: N requests sharing a long prefix plus a few unique tokens: radix cache on vs
   off — mean time to first token and total time.

    python benchmarks/bench_offline.py [--which throughput,shared-prefix] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from bench_common import load_hf, small_checkpoint

from mci.cache.config import CacheConfig
from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine
from mci.models.loader import load_model
from mci.scheduler.config import SchedulerConfig
from mci.tokenizer import TextTokenizer


def _prompts(n: int, length: int, vocab: int, seed: int, prefix: list[int] | None = None):
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(10, vocab, (n, length), generator=gen).tolist()
    return [(prefix or []) + row for row in body]


def run_engine(engine: Engine, prompts, out_len: int) -> dict:
    """Submit all at once; returns total seconds, output tokens, mean/p50 TTFT."""
    params = SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True)
    first: dict[str, float] = {}
    cond = threading.Condition()
    finished: list = []
    start = time.perf_counter()

    def sink(out):
        if out.request_id not in first and out.new_token_ids:
            first[out.request_id] = time.perf_counter() - start
        if out.finished:
            finished.append(out)

    for i, p in enumerate(prompts):
        engine.add_request(p, params, sink, f"b{i}")
    with cond:
        engine.run_until(lambda: len(finished) == len(prompts), cond)
    total = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in finished)
    ttft = list(first.values())
    return {
        "seconds": round(total, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / total, 1),
        "ttft_mean_s": round(statistics.mean(ttft), 3),
        "ttft_p50_s": round(statistics.median(ttft), 3),
    }


def run_hf_static(hf, prompts, out_len: int) -> dict:
    x = torch.tensor(prompts)  # equal lengths: no padding needed
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    total = time.perf_counter() - start
    tokens = (out.shape[1] - x.shape[1]) * x.shape[0]
    return {
        "seconds": round(total, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / total, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--which", default="throughput,shared-prefix")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--unique-len", type=int, default=32)
    ap.add_argument("--prefix-output-len", type=int, default=32)
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()

    path = small_checkpoint(args.checkpoint_dir, args.dtype)
    model = load_model(path, args.dtype)
    tok = TextTokenizer.load(path)
    vocab = model.cfg.vocab_size
    results: dict = {"checkpoint": "small", "dtype": args.dtype, "threads": torch.get_num_threads()}

    def engine(radix: bool) -> Engine:
        cfg = EngineConfig(
            model=ModelPlacement(model_path=path, dtype=args.dtype),
            cache=CacheConfig(max_total_tokens=80_000, disable_radix_cache=not radix),
            scheduler=SchedulerConfig(max_running_requests=256),
        )
        return Engine(cfg, model, tok, background=False)

    if "throughput" in args.which:
        prompts = _prompts(args.num_requests, args.input_len, vocab, seed=1)
        eng = engine(radix=True)
        run_engine(eng, prompts[:2], 4)  # warm-up
        ours = run_engine(eng, prompts, args.output_len)
        eng.shutdown()
        hf = load_hf(path, args.dtype)
        run_hf_static(hf, prompts[:2], 4)
        theirs = run_hf_static(hf, prompts, args.output_len)
        del hf
        results["throughput"] = {
            "workload": f"{args.num_requests} x {args.input_len} in / {args.output_len} out",
            "mci": ours,
            "hf_static_batch": theirs,
            "speedup_vs_hf": round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 2),
        }
    if "shared-prefix" in args.which:
        prefix = _prompts(1, args.prefix_len, vocab, seed=2)[0]
        prompts = _prompts(args.num_requests, args.unique_len, vocab, seed=3, prefix=prefix)
        pair = {}
        for radix in (True, False):
            eng = engine(radix)
            run_engine(eng, _prompts(2, 8, vocab, seed=9), 2)  # warm-up, unrelated prefix
            pair["radix_on" if radix else "radix_off"] = run_engine(
                eng, prompts, args.prefix_output_len
            )
            eng.shutdown()
        on, off = pair["radix_on"], pair["radix_off"]
        results["shared_prefix"] = {
            "workload": f"{args.num_requests} x ({args.prefix_len} shared + {args.unique_len} "
            f"unique) in / {args.prefix_output_len} out",
            **pair,
            "ttft_speedup": round(off["ttft_mean_s"] / on["ttft_mean_s"], 2),
            "total_speedup": round(off["seconds"] / on["seconds"], 2),
        }
    print(json.dumps(results, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
