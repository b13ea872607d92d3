#!/usr/bin/env python3
"""Tiered prefix cache figures (docs/hicache.md), on `mci serve --enable-hierarchical-cache`:

  multiturn  C conversations x T turns (SGLang's multi-turn HiCache benchmark's shape): each
             conversation starts from its own long context and every turn adds a question and
             the answer to its history; turns go round the conversations, K at once, so the
             working set (every history) is several times the KV pool and a conversation comes
             back after the pool has evicted it. TTFT p50/p99, TPOT p50 and output tok/s with
             the tiers (L2 + L3) and without (the radix cache alone), in one run
  restart    the first turn of N conversations, the engine SIGKILLed (the server restarts it),
             then their second turn: TTFT with the file store vs without
  cross      two replicas sharing one store: N prompts computed on replica 1, then sent to
             replica 2: its hit rate (cached / prompt tokens) and TTFT vs replicas without it
  hitcost    in-process: a prefix of 1k/2k/4k (--prefixes) tokens computed, loaded from L2, from L3
             (a fresh engine on the store): time to the first token and its cost per token

    python benchmarks/hicache.py --parts multiturn,restart,cross,hitcost

Model: --model (default: a `small` float32 checkpoint made into a temporary directory; this
machine's CPU runs no bf16 matmuls). Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from tests.server_helpers import LiveServer  # noqa: E402

PAGE = 64


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def tier_flags(store: Path | None, l2_gib: float) -> list[str]:
    flags = ["--enable-hierarchical-cache", "--hicache-size", str(l2_gib)]
    flags += ["--hicache-page-size", str(PAGE)]
    if store is not None:
        flags += ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(store)]
    return flags


async def stream_once(client: httpx.AsyncClient, url: str, prompt: list[int], out: int) -> dict:
    """One streamed completion by token ids: TTFT, TPOT, its output ids and cached tokens."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": out,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    start, first, ids, cached = time.perf_counter(), None, [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    ids += choice["token_ids"]
    end = time.perf_counter()
    return {
        "ttft": first - start,
        "tpot": (end - first) / max(len(ids) - 1, 1),
        "ids": ids,
        "cached": cached,
        "prompt": len(prompt),
    }


def conversations(n: int, context: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8000) for _ in range(context)] for _ in range(n)]


async def multiturn_run(url: str, args) -> dict:
    histories = conversations(args.conversations, args.context, 1)
    rng = random.Random(2)
    results, start = [], time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        sem = asyncio.Semaphore(args.concurrency)
        for _turn in range(args.turns):

            async def one(i: int):
                async with sem:
                    question = [rng.randrange(3, 8000) for _ in range(args.question)]
                    prompt = histories[i] + question
                    r = await stream_once(client, url, prompt, args.output)
                    histories[i] = prompt + r["ids"]
                    results.append(r)

            await asyncio.gather(*(one(i) for i in range(len(histories))))
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    return {
        "requests": len(results),
        "ttft_p50_ms": 1000 * pct(ttft, 0.5),
        "ttft_p99_ms": 1000 * pct(ttft, 0.99),
        "tpot_p50_ms": 1000 * pct([r["tpot"] for r in results], 0.5),
        "output_tok_s": sum(len(r["ids"]) for r in results) / wall,
        "hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        "working_set_tokens": sum(len(h) for h in histories),
        "wall_s": wall,
    }


def pool_flags(name: str, store: str, args) -> list[str]:
    """The KV pool's size, and the tiers (L2 and the file store in `store`) for "with"."""
    flags = ["--max-total-tokens", str(args.pool)]
    return flags + tier_flags(Path(store), args.l2_gib) if name == "with" else flags


def serve(model: Path, *flags: str) -> LiveServer:
    return LiveServer(model, "--served-model-name", "m", *flags, startup_s=300)


def part_multiturn(model: Path, args) -> dict:
    out = {"pool_tokens": args.pool}
    for name in ("without", "with"):
        with tempfile.TemporaryDirectory() as store:
            with serve(model, *pool_flags(name, store, args)) as server:
                out[name] = asyncio.run(multiturn_run(server.url, args))
    out["ttft_p50_ratio"] = out["with"]["ttft_p50_ms"] / out["without"]["ttft_p50_ms"]
    out["ttft_p99_ratio"] = out["with"]["ttft_p99_ms"] / out["without"]["ttft_p99_ms"]
    out["tpot_p50_ratio"] = out["with"]["tpot_p50_ms"] / out["without"]["tpot_p50_ms"]
    out["throughput_ratio"] = out["with"]["output_tok_s"] / out["without"]["output_tok_s"]
    return out


def wait_healthy(url: str, timeout_s: float = 120) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("not healthy after the kill")


def wait_written(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tiers = httpx.get(url + "/internal/state", timeout=10).json()["hicache"]["tiers"]
        if tiers["storage"]["queued"] == 0:
            return
        time.sleep(0.2)


async def turns(url: str, prompts: list[list[int]], out: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        return [await stream_once(client, url, p, out) for p in prompts]


def part_restart(model: Path, args) -> dict:
    firsts = conversations(args.n, args.context, 3)
    out = {}
    for name in ("without", "with"):
        with tempfile.TemporaryDirectory() as store:
            with serve(model, *pool_flags(name, store, args)) as server:
                done = asyncio.run(turns(server.url, firsts, args.output))
                if name == "with":
                    wait_written(server.url)
                os.kill(server.state()["engine_pid"], signal.SIGKILL)
                time.sleep(0.5)
                recovered_s = wait_healthy(server.url)
                seconds = [f + d["ids"] + [5, 6, 7, 8] for f, d in zip(firsts, done, strict=True)]
                after = asyncio.run(turns(server.url, seconds, args.output))
        out[name] = {
            "recovered_s": recovered_s,
            "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in after),
            "hit_rate": sum(r["cached"] for r in after) / sum(r["prompt"] for r in after),
        }
    out["ttft_p50_ratio"] = out["with"]["ttft_p50_ms"] / out["without"]["ttft_p50_ms"]
    return out


def part_cross(model: Path, args) -> dict:
    prompts = conversations(args.n, args.context, 4)
    out = {}
    for name in ("without", "with"):
        with tempfile.TemporaryDirectory() as store:
            flags = ["--max-total-tokens", str(args.pool), "--cpu-threads", "1"]
            flags += tier_flags(Path(store) if name == "with" else None, args.l2_gib)
            with serve(model, *flags) as a, serve(model, *flags) as b:
                asyncio.run(turns(a.url, prompts, args.output))
                if name == "with":
                    wait_written(a.url)
                on_b = asyncio.run(turns(b.url, prompts, args.output))
        out[name] = {
            "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in on_b),
            "hit_rate": sum(r["cached"] for r in on_b) / sum(r["prompt"] for r in on_b),
        }
    out["ttft_p50_ratio"] = out["with"]["ttft_p50_ms"] / out["without"]["ttft_p50_ms"]
    return out


def part_hitcost(model: Path, args) -> dict:
    """Each prefix length: R prompts computed, then served from L2 (after the pool evicted
    them), then from L3 (a fresh engine on the store); medians of the time to the first token,
    and the tiers' own load time per token (their histograms' sums / tokens loaded)."""
    from mci.cache.config import CacheConfig
    from mci.core.sampling_params import SamplingParams
    from mci.engine.config import EngineConfig, ModelPlacement
    from mci.engine.engine import Engine

    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(5)
    prefixes = {
        n: [[rng.randrange(3, 8000) for _ in range(n)] for _ in range(args.repeats)]
        for n in args.prefixes
    }
    out = {n: {} for n in prefixes}
    pool = max(9000, max(prefixes) + 2000)  # a prefix fits, and 3 floods of a third evict it
    flood = pool // 3 + 1
    with tempfile.TemporaryDirectory() as store:

        def engine() -> Engine:
            cache = CacheConfig(
                max_total_tokens=pool,
                enable_hierarchical_cache=True,
                hicache_size=args.l2_gib,
                hicache_page_size=PAGE,
                hicache_storage_backend="file",
                hicache_storage_dir=store,
            )
            return Engine(EngineConfig(model=ModelPlacement(model_path=model), cache=cache))

        def timed(e: Engine, ids: list[int]) -> float:
            start = time.perf_counter()
            e.generate(ids, one)
            return 1000 * (time.perf_counter() - start)

        def per_token_us(e: Engine, tier: str) -> float:
            t = e.stats()["hicache"]["tiers"][tier]
            return 1e6 * t["load_seconds"]["sum"] / max(t["hit_tokens"], 1)

        e = engine()
        e.generate([rng.randrange(3, 8000) for _ in range(500)], one)  # first-request costs
        for n, group in prefixes.items():
            out[n]["computed_ms"] = statistics.median(timed(e, ids) for ids in group)
            for _ in range(3):  # evict them from the pool: a pool's worth of others
                e.generate([rng.randrange(3, 8000) for _ in range(flood)], one)
            out[n]["l2_ms"] = statistics.median(timed(e, ids) for ids in group)
        out["l2_load_us_per_token"] = per_token_us(e, "host")
        e.kv.tiers.flush()
        e.shutdown()
        fresh = engine()  # L1 and L2 empty: the store only
        fresh.generate([rng.randrange(3, 8000) for _ in range(500)], one)
        for n, group in prefixes.items():
            out[n]["l3_ms"] = statistics.median(timed(fresh, ids) for ids in group)
        out["l3_load_us_per_token"] = per_token_us(fresh, "storage")
        fresh.shutdown()
    for n in prefixes:
        row = out[n]
        for tier in ("l2", "l3"):
            row[f"{tier}_vs_computed"] = row[f"{tier}_ms"] / row["computed_ms"]
        row["computed_us_per_token"] = 1000 * row["computed_ms"] / n
    return out


PARTS = {
    "multiturn": part_multiturn,
    "restart": part_restart,
    "cross": part_cross,
    "hitcost": part_hitcost,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="multiturn,restart,cross,hitcost")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--context", type=int, default=448, help="tokens of a conversation's start")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--pool", type=int, default=11000, help="KV pool tokens (L1)")
    ap.add_argument("--l2-gib", type=float, default=0.5)
    ap.add_argument("--n", type=int, default=16, help="conversations of restart and cross")
    ap.add_argument("--repeats", type=int, default=3, help="prompts per prefix length (hitcost)")
    ap.add_argument(
        "--prefixes", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4000]
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "small"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "mci",
                    "make-checkpoint",
                    "--size",
                    "small",
                    "--dtype",
                    "float32",
                    "--out",
                    str(model),
                ],
                check=True,
                capture_output=True,
            )
        for name in args.parts.split(","):
            print(json.dumps({"part": name, **PARTS[name](model, args)}), flush=True)


if __name__ == "__main__":
    main()
