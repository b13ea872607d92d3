#!/usr/bin/env python3
"""Prefill-decode disaggregation figures (docs/disaggregation.md), on this machine's 2 cores:
one prefill worker and one decode worker pinned to one core each (`taskset`, --cpu-threads 1)
behind `mci router --pd-disaggregation`, against one colocated `mci serve` on both cores.
The same requests go to both.

  bursts    steady decode load (S streams, each a short prompt and a long answer, sent again
            as soon as it ends) plus long prompts arriving as a Poisson process at rising
            rates: TPOT p50/p99 (and inter-token p99) of the steady streams, TTFT p50/p99 of
            the long prompts, and goodput (requests per second meeting both the TTFT and the
            TPOT SLO, DistServe's measure) at each rate; a plot
  transfer  one request at a time with prompts of 1k/4k/16k tokens: the bytes and the
            milliseconds its KV took between the workers (the decode worker's own count), and
            that time's share of the request's TTFT; TTFT colocated beside it

    python benchmarks/disaggregation.py --model CKPT --parts bursts,transfer --plot F.png

CKPT: a checkpoint whose context holds the longest prompt (e.g. `mci make-checkpoint --size
small --dtype float32 --context 32768`). Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server_helpers import free_port  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Proc:
    """A pinned `mci` command (`taskset -c CPUS`), up once its /health is 200."""

    def __init__(self, cpus: str | None, *words: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pin = ["taskset", "-c", cpus] if cpus else []
        cmd = [*pin, sys.executable, "-m", "mci", *words, "--port", str(self.port)]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 300) -> Proc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.url} not healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def worker_flags(model: Path, args) -> list[str]:
    return [
        "--model-path", str(model), "--dtype", args.dtype, "--served-model-name", "m",
        "--max-total-tokens", str(args.pool), "--chunked-prefill-size", str(args.chunk),
    ]  # fmt: skip


class Deployment:
    """`colocated`: one server on both cores. `pd`: a prefill and a decode worker on a core
    each, behind the router. `url` takes the requests; `decode_url` reports transfers."""

    def __init__(self, kind: str, model: Path, args, logs: Path):
        self.kind, self.procs = kind, []
        flags = worker_flags(model, args)
        if kind == "colocated":
            server = Proc("0,1", "serve", *flags, log=logs / "colocated.log")
            self.procs = [server.wait()]
            self.url = self.decode_url = server.url
            return
        bootstrap = str(free_port())
        one = ("--cpu-threads", "1")
        prefill = Proc(
            "0", "serve", *flags, *one, "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", bootstrap, log=logs / "prefill.log",
        )  # fmt: skip
        decode = Proc(
            "1", "serve", *flags, *one, "--disaggregation-mode", "decode", log=logs / "decode.log"
        )
        prefill.wait(), decode.wait()
        router = Proc(
            None, "router", "--pd-disaggregation", "--prefill", prefill.url,
            "--decode", decode.url, log=logs / "router.log",
        )  # fmt: skip
        self.procs = [prefill, decode, router.wait()]
        deadline = time.monotonic() + 30
        while not all(
            w["bootstrap"]
            for w in httpx.get(router.url + "/workers").json()["workers"]
            if w["role"] == "prefill"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the router never read the prefill worker's bootstrap")
            time.sleep(0.2)
        self.url, self.decode_url = router.url, decode.url

    def transfers(self) -> dict:
        state = httpx.get(self.decode_url + "/internal/state", timeout=30).json()
        return state.get("disaggregation") or {}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], out: int) -> dict:
    """One streamed completion by token ids: arrival, first token and each token's time."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": out, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    start, times = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"start": start, "error": r.status_code, "prompt": len(prompt)}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                now = time.perf_counter()
                times += [now] * len(choice.get("token_ids") or [])
    if not times:
        return {"start": start, "error": "no tokens", "prompt": len(prompt)}
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "start": start,
        "prompt": len(prompt),
        "ttft": times[0] - start,
        "tpot": (times[-1] - times[0]) / max(len(times) - 1, 1),
        "itl": gaps,
        "tokens": len(times),
    }


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 8000) for _ in range(n)]


async def bursts_level(url: str, rate: float, args, seed: int) -> dict:
    """Steady streams plus long prompts at `rate` per second, for args.seconds."""
    rng, arrival = random.Random(seed), random.Random(seed + 1000)  # arrivals alike in each run
    steady, long = [], []
    stop_at = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(timeout=600) as client:

        async def stream_forever(k: int):
            while time.perf_counter() < stop_at:
                r = await stream(client, url, random_ids(rng, args.steady_prompt), args.steady_out)
                steady.append(r)

        async def arrivals():
            tasks = []
            while True:
                await asyncio.sleep(arrival.expovariate(rate))
                if time.perf_counter() >= stop_at:
                    break
                prompt = random_ids(rng, args.long_prompt)
                tasks.append(asyncio.create_task(stream(client, url, prompt, args.long_out)))
            for task in tasks:
                long.append(await task)

        await asyncio.gather(arrivals(), *(stream_forever(k) for k in range(args.streams)))
    done = [r for r in steady + long if "error" not in r]
    good = [
        r
        for r in done
        if r["ttft"] <= args.slo_ttft_ms / 1e3 and r["tpot"] <= args.slo_tpot_ms / 1e3
    ]
    ok_steady = [r for r in steady if "error" not in r]
    ok_long = [r for r in long if "error" not in r]
    itl = [g for r in ok_steady for g in r["itl"]]
    return {
        "rate": rate,
        "long_requests": len(long),
        "steady_requests": len(steady),
        "errors": len(steady) + len(long) - len(done),
        "steady_tpot_p50_ms": 1e3 * pct([r["tpot"] for r in ok_steady], 0.5),
        "steady_tpot_p99_ms": 1e3 * pct([r["tpot"] for r in ok_steady], 0.99),
        "steady_itl_p99_ms": 1e3 * pct(itl, 0.99),
        "long_ttft_p50_ms": 1e3 * pct([r["ttft"] for r in ok_long], 0.5),
        "long_ttft_p99_ms": 1e3 * pct([r["ttft"] for r in ok_long], 0.99),
        "steady_ttft_p99_ms": 1e3 * pct([r["ttft"] for r in ok_steady], 0.99),
        "goodput_rps": len(good) / args.seconds,
        "attained": len(good) / max(len(done), 1),
        # every request (steady or long, TTFT s, TPOT s): goodput under other SLOs
        "raw": [("steady", r["ttft"], r["tpot"]) for r in ok_steady]
        + [("long", r["ttft"], r["tpot"]) for r in ok_long],
    }


async def warm(url: str, args) -> None:
    """Every kernel shape and the workers' first transfer, before anything is timed."""
    rng = random.Random(99)
    async with httpx.AsyncClient(timeout=600) as client:
        for n in (args.steady_prompt, args.long_prompt):
            await stream(client, url, random_ids(rng, n), 4)


def part_bursts(model: Path, args, logs: Path) -> dict:
    rates = [float(r) for r in args.rates.split(",")]
    out = {"rates": rates, "colocated": [], "pd": []}
    for kind in ("colocated", "pd"):
        deployment = Deployment(kind, model, args, logs)
        try:
            asyncio.run(warm(deployment.url, args))
            for i, rate in enumerate(rates):
                level = asyncio.run(bursts_level(deployment.url, rate, args, seed=i))
                shown = {k: v for k, v in level.items() if k != "raw"}
                print(json.dumps({"part": "bursts", "kind": kind, **shown}), flush=True)
                out[kind].append(level)
        finally:
            deployment.stop()
    if args.plot:
        plot(out, args)
    return out


def plot(out: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = out["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (
        ("steady_tpot_p99_ms", "steady streams: TPOT p99 (ms)"),
        ("long_ttft_p99_ms", "long prompts: TTFT p99 (ms)"),
        ("goodput_rps", f"goodput (req/s, TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= "
                        f"{args.slo_tpot_ms:g} ms)"),
    )  # fmt: skip
    for ax, (key, title) in zip(axes, panels, strict=True):
        for kind, label in (("colocated", "colocated, 2 cores"), ("pd", "prefill + decode")):
            ax.plot(rates, [level[key] for level in out[kind]], marker="o", label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"long prompts per second ({args.long_prompt} tokens)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def part_transfer(model: Path, args, logs: Path) -> dict:
    lengths = [int(n) for n in args.lengths.split(",")]
    out = {}
    for kind in ("colocated", "pd"):
        deployment = Deployment(kind, model, args, logs)
        try:
            asyncio.run(warm(deployment.url, args))
            rows = []
            for n in lengths:
                for rep in range(args.reps):
                    before = deployment.transfers()
                    prompt = random_ids(random.Random(1000 * n + rep), n)

                    async def once(url=deployment.url, prompt=prompt):
                        async with httpx.AsyncClient(timeout=1200) as client:
                            return await stream(client, url, prompt, 2)

                    r = asyncio.run(once())
                    after = deployment.transfers()
                    row = {"prompt": n, "ttft_ms": 1e3 * r["ttft"]}
                    if kind == "pd":
                        ms = 1e3 * (after["transfer_seconds"] - before.get("transfer_seconds", 0))
                        row["transfer_ms"] = ms
                        row["transfer_bytes"] = after["transfer_bytes"] - before.get(
                            "transfer_bytes", 0
                        )
                        row["share_of_ttft"] = ms / row["ttft_ms"]
                    rows.append(row)
                    print(json.dumps({"part": "transfer", "kind": kind, **row}), flush=True)
            out[kind] = rows
        finally:
            deployment.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--parts", default="bursts,transfer")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--pool", type=int, default=60000, help="KV tokens per worker")
    parser.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    parser.add_argument("--streams", type=int, default=4, help="steady decode streams")
    parser.add_argument("--steady-prompt", type=int, default=64)
    parser.add_argument("--steady-out", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--long-out", type=int, default=16)
    parser.add_argument("--rates", default="0.05,0.1,0.2,0.3")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--slo-ttft-ms", type=float, default=8000)
    parser.add_argument("--slo-tpot-ms", type=float, default=60)
    parser.add_argument("--lengths", default="1000,4000,16000")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/mci-pd-bench"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    parts = {"bursts": part_bursts, "transfer": part_transfer}
    for name in args.parts.split(","):
        result = parts[name](args.model, args, args.logs)
        print(json.dumps({"part": name, "summary": result}), flush=True)


if __name__ == "__main__":
    main()
