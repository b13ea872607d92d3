#!/usr/bin/env python3
"""Cache-aware vs round-robin routing, in one run: 2 `mci serve` replicas of the `small`
checkpoint (bf16) behind `mci router`, `mci bench serve` through the router with 8 prompt
families sharing 1,024-token prefixes (64 requests, each in a family drawn at random, 32
unique tokens + 32 out each, Poisson arrivals, 16 requests/s by default), after a warm-up of each
replica. Policies alternate within each round; medians printed with each replica's estimated
cache-hit rate. Both replicas share this machine's 2 cores.

    python benchmarks/router.py --rounds 2

Needs the checkpoint of benchmarks/prepare_checkpoint.sh (benchmarks/.peers/small-bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CKPT = Path(__file__).resolve().parent / ".peers" / "small-bf16"
POLICIES = ("cache_aware", "round_robin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int, threads: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mci", *args, "--port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{args[0]} on {port} did not start")


def bench(url: str, dataset: str, *args: str) -> dict:
    """`mci bench serve` against `url` (greedy, EOS ignored); its summary."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "mci", "bench", "serve", "--base-url", url, "--model", "m"]
        extra = ["--ignore-eos", "--disable-tqdm", "--output-json", out.name]
        subprocess.run(
            cmd + ["--dataset", dataset, *args, *extra], check=True, stdout=subprocess.DEVNULL
        )
        return json.loads(Path(out.name).read_text())


def one_run(policy: str, rate: float) -> dict:
    ports = [free_port() for _ in range(3)]
    serve = ["serve", "--model-path", str(CKPT), "--dtype", "bfloat16", "--served-model-name", "m"]
    # one core each: two engines spinning OpenMP teams over the same 2 cores slow both badly
    replicas = [start(serve, p, threads=1) for p in ports[:2]]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    router = start(["router", "--policy", policy, "--worker-urls", *urls], ports[2])
    try:
        for url in urls:  # warm-up on each replica (kernels, allocator), not through the router
            bench(
                url, "random", "--input-len", "512", "--output-len", "16",
                "--num-prompts", "8", "--seed", "99", "--request-rate", "inf",
            )  # fmt: skip
        summary = bench(
            f"http://127.0.0.1:{ports[2]}",
            "shared-prefix",
            "--num-prefixes", "8", "--prefix-len", "1024", "--input-len", "32",
            "--output-len", "32", "--num-prompts", "64", "--request-rate", str(rate),
        )  # fmt: skip
        workers = httpx.get(f"http://127.0.0.1:{ports[2]}/workers").json()["workers"]
        summary["hit_rates"] = [round(w["estimated_cache_hit_rate"], 2) for w in workers]
        summary["requests"] = [w["requests"] for w in workers]
        return summary
    finally:
        for proc in (router, *replicas):
            proc.terminate()
        for proc in (router, *replicas):
            proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--request-rate", type=float, default=16.0, help="Poisson arrivals per s")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for _ in range(args.rounds):
        for policy in POLICIES:
            s = one_run(policy, args.request_rate)
            runs[policy].append(s)
            print(
                policy,
                s["output_token_throughput"],
                s["ttft_ms"],
                s["hit_rates"],
                s["requests"],
                file=sys.stderr,
                flush=True,
            )
    print(
        "| policy | output tok/s | TTFT p50 ms | TTFT p99 ms | est. hit rate per replica | "
        "requests per replica |"
    )
    print("|---|---|---|---|---|---|")
    for policy, rs in runs.items():
        tps = statistics.median(r["output_token_throughput"] for r in rs)
        p50 = statistics.median(r["ttft_ms"]["p50"] for r in rs)
        p99 = statistics.median(r["ttft_ms"]["p99"] for r in rs)
        print(
            f"| {policy} | {tps:.0f} | {p50:.0f} | {p99:.0f} | {rs[-1]['hit_rates']} | "
            f"{rs[-1]['requests']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
