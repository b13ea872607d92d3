#!/usr/bin/env python3
"""Residency under a replica's death: does a region-pinned tenant's traffic ever leave its
region, and how soon is it served again?

Two `mci serve` replicas of the bundled default model (one core each), labelled `--region eu`
and `--region us`, behind `mci router --tenants` (default health checks, 1 s). A tenant pinned
to eu sends 1,000 completions (8 tokens each, at most 8 at once, paced at --rate per second).
After --kill-after of them have finished, the eu replica is SIGKILLed (its whole process
group: front end and engine) and started again on its port --down-s seconds later. Printed as
JSON: the answers by status (200, 503 fail-closed, other), the requests the us replica saw
(from its own /metrics before and after: must be 0), the router's residency rejections, and
the times from the kill to the first 503 and from the restart to the first success after it.

    python benchmarks/residency.py [--requests 1000] [--rate 40] [--kill-after 200] [--down-s 3]
                                   [--breaker-cooldown 10]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

KEY = "sk-bench-eu"  # the pinned tenant's key (a benchmark's own file)
TENANTS = {"tenants": {"acme": {"api_keys": [KEY], "regions": ["eu"]}}}
# what reaching a replica leaves in its own /metrics, whatever the request's fate
ARRIVALS = (
    "mci:request_success_total",
    "mci:requests_rejected_total",
    "mci:requests_aborted_total",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], port: int) -> subprocess.Popen:
    """`mci ARGS --port PORT` in its own process group (so a kill takes its engine too), on
    one OpenMP thread: two replicas and the router share this machine's cores."""
    cmd = [sys.executable, "-m", "mci", *args, "--port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )


def wait_healthy(port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing healthy on port {port}")


def wait_admitted(port: int, count: int, timeout_s: float = 60) -> None:
    """Until the router on `port` has all `count` workers available with their labels (it
    may start before them, and then re-admits them at its next health checks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=5).json()["workers"]
        if sum(w["available"] and w["region"] is not None for w in workers) == count:
            return
        time.sleep(0.1)
    raise RuntimeError("the router did not admit every worker")


def arrivals(port: int) -> float:
    """Requests that reached the replica on `port` (its own counters)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(ARRIVALS) and not line.startswith("#")
    )


def rejections(port: int) -> dict:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    name = "mci_router:residency_rejections_total{reason="
    return {
        line[len(name) + 1 : line.index('"}')]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name)
    }


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


async def load(args, router: str, eu_port: int, eu: list) -> dict:
    """The tenant's requests, paced; the eu replica killed and restarted meanwhile."""
    statuses = collections.Counter()
    early = []  # 503 bodies before the kill
    events = {}  # kill, first_503, restart, healthy, first_success_after_restart
    done = asyncio.Event()  # --kill-after requests have finished
    finished = 0
    gate = asyncio.Semaphore(args.concurrency)
    headers = {"authorization": f"Bearer {KEY}"}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal finished
        async with gate:
            body = {"prompt": f"request {i}:", "max_tokens": 8, "temperature": 0}
            try:
                r = await client.post(router + "/v1/completions", json=body, headers=headers)
                status = r.status_code
            except httpx.HTTPError:
                status = "connection"
            now = time.monotonic()
            statuses[status] += 1
            if status == 503:
                events.setdefault("first_503", now)
                if "kill" not in events:  # before the kill: not residency's doing
                    early.append(r.text[:300])
            if status == 200 and "restart" in events:
                events.setdefault("first_success_after_restart", now)
            finished += 1
            if finished == args.kill_after:
                done.set()

    async def chaos() -> None:
        await done.wait()
        os.killpg(eu[0].pid, signal.SIGKILL)
        eu[0].wait()
        events["kill"] = time.monotonic()
        await asyncio.sleep(args.down_s)
        events["restart"] = time.monotonic()
        eu[0] = spawn(["serve", "--region", "eu"], eu_port)
        await asyncio.to_thread(wait_healthy, eu_port)
        events["healthy"] = time.monotonic()

    async with httpx.AsyncClient(timeout=60) as client:
        chaos_task = asyncio.create_task(chaos())
        start = time.monotonic()
        tasks = []
        for i in range(args.requests):
            await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, i)))
        await asyncio.gather(*tasks)
        await chaos_task
        events["end"] = time.monotonic()
    return {"statuses": statuses, "events": events, "wall_s": events["end"] - start, "early": early}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rate", type=float, default=40.0, help="requests started per second")
    ap.add_argument("--kill-after", type=int, default=200, help="finished requests before the kill")
    ap.add_argument("--down-s", type=float, default=3.0, help="seconds before the restart")
    ap.add_argument(
        "--breaker-cooldown", type=float, default=10.0, help="the router's (its default: 10)"
    )
    args = ap.parse_args()
    eu_port, us_port, router_port = free_port(), free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(TENANTS, f)
    eu = [spawn(["serve", "--region", "eu"], eu_port)]
    us = spawn(["serve", "--region", "us"], us_port)
    workers = [f"http://127.0.0.1:{p}" for p in (eu_port, us_port)]
    flags = ["--tenants", f.name, "--breaker-cooldown", str(args.breaker_cooldown)]
    router = spawn(["router", "--worker-urls", *workers, *flags], router_port)
    try:
        for port in (eu_port, us_port, router_port):
            wait_healthy(port)
        wait_admitted(router_port, len(workers))
        us_before = arrivals(us_port)
        run = asyncio.run(load(args, f"http://127.0.0.1:{router_port}", eu_port, eu))
        us_after = arrivals(us_port)
        ev, st = run["events"], run["statuses"]
        report = {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rate_per_s": args.rate,
            "down_s": args.down_s,
            "breaker_cooldown_s": args.breaker_cooldown,
            "ok_200": st.pop(200, 0),
            "fail_closed_503": st.pop(503, 0),
            "other": sum(st.values()),
            "other_by_status": {str(k): v for k, v in st.items()},
            "reached_other_region": us_after - us_before,
            "residency_rejections": rejections(router_port),
            "kill_to_first_503_s": _since(ev, "kill", "first_503"),
            "restart_to_healthy_s": _since(ev, "restart", "healthy"),
            "restart_to_first_success_s": _since(ev, "restart", "first_success_after_restart"),
            "healthy_to_first_success_s": _since(ev, "healthy", "first_success_after_restart"),
            "wall_s": round(run["wall_s"], 2),
            "early_503s": run["early"][:3],
        }
        print(json.dumps(report, indent=2))
        return 0 if report["reached_other_region"] == 0 else 1
    finally:
        for proc in (router, us, eu[0]):
            stop(proc)
        os.unlink(f.name)


def _since(events: dict, start: str, end: str) -> float | None:
    """Seconds from one event to another (None if either did not happen)."""
    if start not in events or end not in events:
        return None
    return round(events[end] - events[start], 3)


if __name__ == "__main__":
    sys.exit(main())
