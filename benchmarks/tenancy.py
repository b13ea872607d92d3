#!/usr/bin/env python3
"""Tenancy figures (docs/tenancy.md), on `mci serve` with a tenants file:

  noisy     tenant B sends a steady Poisson load (64 in / 32 out, 3 req/s, 30 s); tenant A
            floods at 10x its quota (max_running_requests 2 + max_queued_requests 2: 40
            clients sending at all times, 1,024-token prompts, each waiting out Retry-After
            after a 429, as the OpenAI client does). B's TTFT p50/p99 and TPOT p50 three
            ways in one run: B alone, B + A under fcfs, B + A under fair; A's 429s counted
  bound     two backlogged tenants, weights 1 and 3, different shapes (A short prompts and
            long outputs, B long prompts and short outputs), under fair: the service ratio
            over time from /internal/state (plot) and the largest gap between their counters
            vs VTC's bound (2x the largest counter one request adds)
  cost      benchmarks/run.py's batch workload (32 at once, 128 in / 128 out) through
            `mci bench serve`, fcfs vs fair, alternating, --rounds each

    python benchmarks/tenancy.py --parts noisy,bound,cost [--plot docs/tenancy-fairness.png]

Model: benchmarks/.peers/small-bf16 (benchmarks/prepare_checkpoint.sh), else the bundled one.
Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.run import WORKLOADS  # noqa: E402
from mci.scheduler.fair_share import INPUT_TOKEN_COST, OUTPUT_TOKEN_COST  # noqa: E402
from tests.server_helpers import free_port  # noqa: E402

SMALL = ROOT / "benchmarks" / ".peers" / "small-bf16"
TENANTS = {
    "tenants": {
        "a": {
            "api_keys": ["sk-a"],
            "weight": 1,
            "max_running_requests": 2,
            "max_queued_requests": 2,
        },
        "b": {"api_keys": ["sk-b"], "weight": 1},
    }
}
# the same engine settings in all three runs; prompt chunks of 256 keep a step short, so a
# request arriving behind another tenant's long prompt waits for a short step, not a long one
NOISY_FLAGS = ("--chunked-prefill-size", "256")
WEIGHTED = {
    "tenants": {
        "a": {"api_keys": ["sk-a"], "weight": 1},
        "b": {"api_keys": ["sk-b"], "weight": 3},
    }
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if values else -1
    )


class Server:
    def __init__(self, tenants: dict, policy: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(tenants, self.file)
        self.file.close()
        model = ["--model-path", str(SMALL)] if SMALL.is_dir() else []
        cmd = [sys.executable, "-m", "mci", "serve", "--port", str(self.port), *model]
        cmd += ["--tenants", self.file.name, "--schedule-policy", policy, *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not start")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


async def one(client, url, key, prompt_ids, max_tokens) -> dict:
    body = {
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start, first, last, n = time.monotonic(), None, None, 0
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": float(r.headers.get("retry-after", 1))}
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                now = time.monotonic()
                first = first or now
                last, n = now, n + 1
    tpot = (last - first) / (n - 1) if n > 1 else None
    return {"status": 200, "ttft": first - start if first else None, "tpot": tpot}


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


async def noisy_run(policy: str, flood: bool, seconds: float) -> dict:
    server = Server(TENANTS, policy, "--max-running-requests", "8", *NOISY_FLAGS)
    rng = random.Random(0)
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            for _ in range(3):  # warm-up
                await one(client, server.url, "sk-b", ids(64, rng), 8)
            stop = time.monotonic() + seconds
            a_results: list[dict] = []

            async def flooder():
                while time.monotonic() < stop:
                    r = await one(client, server.url, "sk-a", ids(1024, rng), 64)
                    a_results.append(r)
                    if r["status"] == 429:
                        await asyncio.sleep(r["retry_after"])

            floods = [asyncio.ensure_future(flooder()) for _ in range(40 if flood else 0)]
            b_tasks = []
            while time.monotonic() < stop:
                b_tasks.append(
                    asyncio.ensure_future(one(client, server.url, "sk-b", ids(64, rng), 32))
                )
                await asyncio.sleep(rng.expovariate(3.0))
            b = await asyncio.gather(*b_tasks)
            for f in floods:
                f.cancel()
            await asyncio.gather(*floods, return_exceptions=True)
    finally:
        server.stop()
    ok = [r for r in b if r["status"] == 200]
    ttft = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] * 1000 for r in ok if r["tpot"] is not None]
    return {
        "b_requests": len(b),
        "b_ok": len(ok),
        "b_ttft_p50_ms": round(pct(ttft, 50), 1),
        "b_ttft_p99_ms": round(pct(ttft, 99), 1),
        "b_tpot_p50_ms": round(pct(tpot, 50), 2),
        "a_ok": sum(r["status"] == 200 for r in a_results),
        "a_429": sum(r["status"] == 429 for r in a_results),
    }


def noisy(seconds: float) -> dict:
    out = {"part": "noisy"}
    for name, policy, flood in (
        ("b_alone", "fair", False),
        ("b_and_a_fcfs", "fcfs", True),
        ("b_and_a_fair", "fair", True),
    ):
        out[name] = asyncio.run(noisy_run(policy, flood, seconds))
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    alone = out["b_alone"]["b_ttft_p99_ms"]
    out["fair_p99_vs_alone"] = round(out["b_and_a_fair"]["b_ttft_p99_ms"] / alone, 2)
    out["fcfs_p99_vs_alone"] = round(out["b_and_a_fcfs"]["b_ttft_p99_ms"] / alone, 2)
    return out


async def bound_run(seconds: float) -> dict:
    server = Server(WEIGHTED, "fair", "--max-running-requests", "4")
    shapes = {"a": (16, 96), "b": (384, 8)}  # (prompt, output) tokens
    rng = random.Random(1)
    samples = []
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            stop = time.monotonic() + seconds

            async def backlog(tenant):
                prompt, out = shapes[tenant]
                while time.monotonic() < stop:
                    await one(client, server.url, f"sk-{tenant}", ids(prompt, rng), out)

            tasks = [asyncio.ensure_future(backlog(t)) for t in ("a", "b") for _ in range(6)]
            start = time.monotonic()
            while time.monotonic() < stop:
                await asyncio.sleep(0.25)
                state = (
                    await client.get(
                        server.url + "/internal/state", headers={"authorization": "Bearer sk-a"}
                    )
                ).json()["tenants"]
                if {"a", "b"} <= set(state):
                    samples.append((time.monotonic() - start, state["a"], state["b"]))
            await asyncio.gather(*tasks)
    finally:
        server.stop()
    largest = max(
        (INPUT_TOKEN_COST * p + OUTPUT_TOKEN_COST * o) / w
        for (p, o), w in ((shapes["a"], 1), (shapes["b"], 3))
    )
    steady = samples[len(samples) // 5 :]  # after both are backlogged
    gap = max(abs(a["counter"] - b["counter"]) for _, a, b in steady)
    ratios = [(t, (b["share"] / a["share"]) if a["share"] else None) for t, a, b in samples]
    return {
        "part": "bound",
        "samples": len(samples),
        "service_ratio_b_over_a_end": round(ratios[-1][1], 3),
        "largest_counter_gap": round(gap, 1),
        "vtc_bound": round(2 * largest, 1),
        "ratio_series": [(round(t, 2), round(r, 3) if r else None) for t, r in ratios],
    }


def cost(rounds: int) -> dict:
    args, _ = WORKLOADS["batch"]
    results: dict[str, list[float]] = {"fcfs": [], "fair": []}
    for _ in range(rounds):
        for policy in ("fcfs", "fair"):
            server = Server(WEIGHTED, policy)
            try:
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            "mci",
                            "bench",
                            "serve",
                            "--base-url",
                            server.url,
                            "--api-key",
                            "sk-a",
                            *args,
                            "--ignore-eos",
                            "--output-json",
                            out.name,
                        ],
                        check=True,
                        capture_output=True,
                    )
                    report = json.loads(Path(out.name).read_text())
                results[policy].append(report["output_token_throughput"])
            finally:
                server.stop()
    return {
        "part": "cost",
        "fcfs_tok_s": results["fcfs"],
        "fair_tok_s": results["fair"],
        "fair_vs_fcfs": round(
            sum(results["fair"])
            / len(results["fair"])
            / (sum(results["fcfs"]) / len(results["fcfs"])),
            3,
        ),
    }


def plot(series, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x for x, r in series if r]
    r = [r for _, r in series if r]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(t, r, label="service of B / service of A")
    ax.axhline(3.0, linestyle="--", color="gray", label="weights' ratio (3)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("ratio")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="noisy,bound,cost")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "noisy" in parts:
        print(json.dumps(noisy(args.seconds)), flush=True)
    if "bound" in parts:
        result = asyncio.run(bound_run(args.seconds))
        if args.plot:
            plot(result["ratio_series"], args.plot)
        result["ratio_series"] = result["ratio_series"][
            :: max(1, len(result["ratio_series"]) // 12)
        ]
        print(json.dumps(result), flush=True)
    if "cost" in parts:
        print(json.dumps(cost(args.rounds)), flush=True)


if __name__ == "__main__":
    main()
