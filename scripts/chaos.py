"""The chaos and soak suite: `mci serve` under the failures it must survive.

    python scripts/chaos.py --soak-seconds 600 --out chaos-results     # make chaos
    python scripts/chaos.py --soak-seconds 30 --out DIR                # CI (tests/test_chaos.py)
    python scripts/chaos.py --soak-only --soak-seconds 3600 --model-path DIR  # a memory soak

It starts its own `mci serve` (the bundled model unless --model-path), then runs, in order:

1. disconnect storm: 64 streams and requests whose clients leave after a few chunks or a
   short timeout; then nothing may remain in flight and the KV pool must be free and intact.
2. overload: ten times what the server admits (running + queued), at once: every answer is a
   200 that completes or a 429 with Retry-After; never a 5xx.
3. malformed and fuzzed bodies: broken JSON, wrong types, bad values, oversized bodies,
   seeded random mutations of valid bodies: every answer is a 4xx.
4. engine signals under load: SIGTERM (ignored: the front end decides), SIGKILL (restart),
   SIGSTOP (the watchdog's kill and restart). No client may hang; a failure is allowed only
   for a request that had started streaming (error event `engine_died`) — every other
   request completes. The time to healthy again is measured for SIGKILL and SIGSTOP.
5. soak: mixed traffic for --soak-seconds from --soak-workers clients with no back-off
   (streams, client cuts, chats, n > 1, stop strings, logprobs with and without echo,
   near-limit prompts, bursts past the queue bound), sampling each process's RSS and the KV
   usage every second, and the engine's heap (in use, free) every 5 s. Passes with 0 5xx, no
   lost request (every 200 ends with a finish reason), KV usage 0 and integrity ok at the
   end, and the engine's memory bounded: its RSS after the warm-up (the first quarter, at
   most 5 minutes) growing < 5%, and its peak under the memory plan the engine states at
   start (mci/engine/memory_plan.py) plus the process's own PROCESS_OWN_BYTES. The slope of
   the engine's RSS over the soak's second half is reported (MB per hour).
6. SIGTERM of the server with requests in flight: they complete, the process exits 0.

Results: OUT/chaos.json (every figure and check) and OUT/chaos.png (RSS, KV usage, outcomes
over time). Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from mci.process_memory import rss_bytes

MAX_RUNNING = 8
MAX_QUEUED = 24
CONTEXT = 1024
WATCHDOG_S = 3.0
MAX_QUEUE_TIME_S = 30.0
LOAD_BEFORE_SIGNAL_S = 2.0
RECOVERY_BOUND_S = 60.0  # a killed or hung engine serves again within this (the model loads)
CLIENT_BOUND_S = 120.0  # no client may wait longer than this for an answer
WARMUP_SHARE = 0.25  # of the soak: RSS is compared against its end ...
WARMUP_MAX_S = 300.0  # ... or against the end of its first 5 minutes, the shorter
RSS_GROWTH_LIMIT = 0.05  # the engine's RSS after warm-up, at the end
PROCESS_OWN_BYTES = 512 * 2**20  # an engine process beside its plan: Python, torch, libraries
SOAK_WORKERS = 48
HEAP_EVERY_S = 5.0
# Clients drop idle connections before the server's keep-alive timeout (uvicorn: 5 s) does:
# otherwise a request sent on a connection the server is closing meets a reset, a race of the
# client's pool, not a server failure.
KEEPALIVE_EXPIRY_S = 1.0  # shorter soaks report RSS growth without judging it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _limits(max_connections: int = 100) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)


class Server:
    """`mci serve` in a subprocess, its log in a file."""

    def __init__(self, out: Path, model_path: str | None, skip_kernel_warmup: bool = False):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "mci", "serve", "--port", str(self.port),
            "--max-running-requests", str(MAX_RUNNING),
            "--max-queued-requests", str(MAX_QUEUED),
            "--context-length", str(CONTEXT),
            "--watchdog-timeout", str(WATCHDOG_S),
            "--max-queue-time", str(MAX_QUEUE_TIME_S),
            "--max-total-tokens", "65536",
        ]  # fmt: skip
        if model_path:
            cmd += ["--model-path", model_path]
        if skip_kernel_warmup:
            cmd.append("--skip-kernel-warmup")
        self.warmed = not skip_kernel_warmup
        self.log = open(out / "server.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready(180)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health is 200 (RuntimeError past `timeout_s`)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see server.log")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready within {timeout_s} s")

    def state(self) -> dict:
        return httpx.get(self.url + "/internal/state", timeout=30).json()

    def wait_idle(self, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                state = self.state()
                if state["in_flight"] == 0 and not state["num_running"] + state["num_waiting"]:
                    return state
            except (httpx.HTTPError, KeyError):
                state = {}
            if time.monotonic() > deadline:
                return state
            time.sleep(0.2)

    def kv_clean(self) -> dict:
        """KV usage 0 (only the prefix tree's unlocked tokens held) and the integrity check."""
        state = self.wait_idle()
        held = state.get("num_slots", 0) - state.get("free_slots", 0) - state.get("tree_tokens", 0)
        return {
            "idle": state.get("in_flight") == 0,
            "kv_held_by_requests": held,
            "tree_locked_tokens": state.get("tree_locked_tokens"),
            "integrity_ok": state.get("integrity_ok", False),
            "ok": bool(
                state
                and held == 0
                and state.get("tree_locked_tokens") == 0
                and state.get("integrity_ok")
                and state.get("in_flight") == 0
            ),
        }

    def engine_pid(self) -> int:
        return self.state()["engine_pid"]

    def engine_generation(self) -> tuple[int, str]:
        """(engine pid, restart and hang counters): unchanged = the engine was undisturbed."""
        metrics = httpx.get(self.url + "/metrics", timeout=10).text
        counters = [
            line
            for line in metrics.splitlines()
            if line.startswith(("mci:engine_restarts_total", "mci:engine_hangs_total"))
        ]
        return self.engine_pid(), " ".join(counters)


# ---- clients -----------------------------------------------------------------------------------
async def completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    path: str = "/v1/completions",
    cut_after_chunks: int | None = None,
) -> dict:
    """One request; the outcome: status, finish reasons seen, whether we cut it, error code."""
    started = time.monotonic()
    outcome: dict = {"status": None, "finished": False, "cut": False, "error_code": None}
    try:
        if not body.get("stream"):
            r = await client.post(url + path, json=body)
            outcome["status"] = r.status_code
            if r.status_code == 429:
                outcome["retry_after"] = r.headers.get("retry-after")
            if r.status_code >= 500:
                outcome["message"] = _error_message(r.content)
            if r.status_code == 200:
                choices = r.json()["choices"]
                outcome["finished"] = all(c.get("finish_reason") for c in choices)
            return outcome
        async with client.stream("POST", url + path, json=body) as r:
            outcome["status"] = r.status_code
            if r.status_code != 200:
                if r.status_code == 429:
                    outcome["retry_after"] = r.headers.get("retry-after")
                outcome["message"] = _error_message(await r.aread())
                return outcome
            chunks, n, finishes = 0, body.get("n", 1), 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome["error_code"] = event["error"].get("code") or "error"
                    break
                chunks += 1
                finishes += sum(1 for c in event.get("choices", []) if c.get("finish_reason"))
                if cut_after_chunks is not None and chunks >= cut_after_chunks:
                    outcome["cut"] = True
                    return outcome
            outcome["finished"] = finishes >= n
            return outcome
    except httpx.TimeoutException:
        outcome["status"] = "client_timeout"
        return outcome
    except httpx.HTTPError as exc:
        outcome["status"] = f"transport:{type(exc).__name__}"
        return outcome
    finally:
        outcome["seconds"] = time.monotonic() - started


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def tally(outcomes: list[dict]) -> dict:
    counts = Counter()
    for o in outcomes:
        s = o["status"]
        if o["cut"]:
            counts["cut_by_client"] += 1
        elif s == 200 and o.get("error_code"):
            counts["200_error_event:" + o["error_code"]] += 1
        elif s == 200:
            counts["200_finished" if o["finished"] else "200_lost"] += 1
        elif s == 503 and "already produced output" in o.get("message", ""):
            counts["503_engine_died"] += 1
        elif s == 503 and o.get("message") == "engine is not running":
            counts["503_not_ready"] += 1
        elif isinstance(s, int):
            counts["5xx" if s >= 500 else str(s)] += 1
        else:
            counts[str(s)] += 1
    return dict(counts)


def _prompt(rng: random.Random, words: int) -> str:
    vocab = ["def", "return", "self", "value", "list", "for", "in", "range", "x", "if", "None"]
    return " ".join(rng.choice(vocab) for _ in range(words))


# ---- scenarios -----------------------------------------------------------------------------------
async def disconnect_storm(server: Server, rng: random.Random) -> dict:
    async def one(i: int):
        body = {"prompt": _prompt(rng, 20), "max_tokens": 200, "ignore_eos": True}
        if i % 2:
            body["stream"] = True
            async with httpx.AsyncClient(limits=_limits(), timeout=60) as c:
                return await completion(c, server.url, body, cut_after_chunks=rng.randint(1, 8))
        async with httpx.AsyncClient(limits=_limits(), timeout=rng.uniform(0.1, 1.0)) as c:
            return await completion(c, server.url, body)

    outcomes = await asyncio.gather(*(one(i) for i in range(64)))
    kv = server.kv_clean()
    counts = tally(outcomes)
    return {"counts": counts, "kv": kv, "ok": kv["ok"] and "5xx" not in counts}


async def overload(server: Server, rng: random.Random) -> dict:
    n = 10 * (MAX_RUNNING + MAX_QUEUED)
    async with httpx.AsyncClient(timeout=CLIENT_BOUND_S, limits=_limits(n)) as c:
        bodies = [
            {"prompt": _prompt(rng, 10), "max_tokens": 8, "stream": bool(i % 2)} for i in range(n)
        ]
        outcomes = await asyncio.gather(*(completion(c, server.url, b) for b in bodies))
    counts = tally(outcomes)
    retry_after = all(o.get("retry_after") for o in outcomes if o["status"] == 429)
    allowed = {"200_finished", "429"}
    kv = server.kv_clean()
    return {
        "requests": n,
        "counts": counts,
        "every_429_has_retry_after": retry_after,
        "kv": kv,
        "ok": set(counts) <= allowed and retry_after and kv["ok"],
    }


def _malformed_bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    valid = {"prompt": "def f(x):", "max_tokens": 4}
    cases = [
        ("not json", b"{nope"),
        ("json array", b"[1, 2]"),
        ("json string", b'"prompt"'),
        ("empty", b""),
        ("invalid utf-8", b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
        ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("oversized body", json.dumps({"prompt": "x" * (5 * 2**20)}).encode()),
    ]
    bad_fields = [
        {"prompt": None},
        {"max_tokens": "ten"},
        {"max_tokens": -1},
        {"temperature": -0.5},
        {"top_p": 2},
        {"n": 0},
        {"logprobs": 100},
        {"prompt": [10**9]},
        {"prompt": [-1, 2]},
        {"prompt": "x " * 5000},
        {"stop": [1, 2]},
        {"unknown_field": True},
        {"logit_bias": {"abc": 1}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
        {"seed": "s"},
        {"stream_options": {"include_usage": True}},
    ]
    for i, change in enumerate(bad_fields):
        cases.append(
            (f"bad field {i}: {list(change)[0]}", json.dumps({**valid, **change}).encode())
        )
    junk = [None, -1, 1e308, "", "\u0000", [], {}, [[]], True, "x" * 1000, 2**70]
    keys = ["prompt", "max_tokens", "temperature", "n", "stop", "logprobs", "top_k", "echo"]
    for i in range(120):  # seeded random mutations of a valid body
        body = dict(valid)
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(keys)] = rng.choice(junk)
        cases.append((f"fuzz {i}", json.dumps(body).encode()))
    return cases


async def malformed(server: Server, rng: random.Random) -> dict:
    statuses: Counter = Counter()
    five_xx = []
    async with httpx.AsyncClient(limits=_limits(), timeout=60) as c:
        for name, raw in _malformed_bodies(rng):
            for path in ("/v1/completions", "/v1/chat/completions"):
                try:
                    r = await c.post(
                        server.url + path, content=raw, headers={"content-type": "application/json"}
                    )
                    status = r.status_code
                except httpx.HTTPError as exc:
                    status = f"transport:{type(exc).__name__}"
                statuses[str(status)] += 1
                if not isinstance(status, int) or status >= 500:
                    five_xx.append(f"{path} {name}: {status}")
    healthy = httpx.get(server.url + "/health", timeout=5).status_code == 200
    kv = server.kv_clean()
    return {
        "statuses": dict(statuses),  # a 200 is a mutation that is still a valid request
        "server_errors": five_xx[:20],
        "healthy_after": healthy,
        "kv": kv,
        "ok": not five_xx and healthy and kv["ok"],
    }


def _load_in_background(server: Server, rng: random.Random, stop: threading.Event, out: list):
    """Streams and plain requests, 8 at a time, until `stop`; outcomes appended to `out`."""

    async def worker(i: int):
        async with httpx.AsyncClient(limits=_limits(), timeout=CLIENT_BOUND_S) as c:
            while not stop.is_set():
                body = {
                    "prompt": _prompt(rng, 16),
                    "max_tokens": rng.choice([16, 64, 256]),
                    "ignore_eos": True,
                    "stream": bool(i % 2),
                }
                outcome = await completion(c, server.url, body)
                out.append(outcome)
                if outcome["status"] in (429, 503):  # as a client should: back off
                    await asyncio.sleep(0.2)

    async def main():
        await asyncio.gather(*(worker(i) for i in range(8)))

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    return thread


def engine_signals(server: Server, rng: random.Random) -> dict:
    results = {}
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP):
        outcomes: list[dict] = []
        stop = threading.Event()
        load = _load_in_background(server, rng, stop, outcomes)
        time.sleep(LOAD_BEFORE_SIGNAL_S)
        pid = server.engine_pid()
        os.kill(pid, sig)
        hit = time.monotonic()
        entry: dict = {}
        if sig == signal.SIGTERM:
            time.sleep(LOAD_BEFORE_SIGNAL_S)
            entry["engine_pid_unchanged"] = server.engine_pid() == pid
        else:
            ready = True
            while ready and time.monotonic() - hit < RECOVERY_BOUND_S:  # not ready, then ready
                try:
                    ready = httpx.get(server.url + "/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    ready = False
                time.sleep(0.0 if not ready else 0.05)
            entry["went_unready"] = not ready
            entry["not_ready_after_s"] = round(time.monotonic() - hit, 2)
            try:
                server.wait_ready(RECOVERY_BOUND_S)
                entry["ready_again_after_s"] = round(time.monotonic() - hit, 2)
            except RuntimeError:
                entry["ready_again_after_s"] = None
            try:
                os.kill(pid, signal.SIGCONT)
                entry["old_engine_gone"] = False
            except ProcessLookupError:
                entry["old_engine_gone"] = True
            time.sleep(LOAD_BEFORE_SIGNAL_S)  # serving again under the same load
        stop.set()
        load.join(CLIENT_BOUND_S + 10)
        counts = tally(outcomes)
        entry.update(counts=counts, clients_hung=load.is_alive(), requests=len(outcomes))
        if sig == signal.SIGTERM:
            entry["ok"] = entry["engine_pid_unchanged"] and set(counts) <= {"200_finished"}
        else:
            # allowed: a request that had produced output fails (an error event, or a 503
            # naming the restart), and one arriving during the restart gets 503 at once
            allowed = {
                "200_finished",
                "200_error_event:engine_died",
                "503_engine_died",
                "503_not_ready",
            }
            entry["ok"] = bool(
                entry["went_unready"]
                and entry["ready_again_after_s"] is not None
                and entry["old_engine_gone"]
                and not load.is_alive()
                and set(counts) <= allowed
            )
        results[signal.Signals(sig).name] = entry
    kv = server.kv_clean()
    results["kv"] = kv
    results["ok"] = kv["ok"] and all(r["ok"] for k, r in results.items() if k.startswith("SIG"))
    return results


class Soak:
    """Mixed traffic for `seconds`, sampling RSS and KV usage every second."""

    def __init__(
        self, server: Server, rng: random.Random, seconds: float, workers: int = SOAK_WORKERS
    ):
        self.server, self.rng, self.seconds, self.workers = server, rng, seconds, workers
        self.outcomes: list[dict] = []
        self.samples: list[dict] = []
        self.heap_samples: list[dict] = []
        self.plan: dict | None = None  # the engine's memory plan (/internal/state)

    def _body(self) -> tuple[str, dict, int | None, str]:
        rng = self.rng
        kind = rng.choice(
            ["stream", "stream_cut", "plain", "chat", "chat_stream", "n", "stop", "logprobs",
             "near_limit"]
        )  # fmt: skip
        base = {"prompt": _prompt(rng, rng.randint(4, 60)), "max_tokens": rng.randint(4, 96)}
        if kind == "stream":
            return "/v1/completions", {**base, "stream": True}, None, kind
        if kind == "stream_cut":
            return (
                "/v1/completions",
                {**base, "stream": True, "max_tokens": 200},
                rng.randint(1, 6),
                kind,
            )
        if kind == "chat" or kind == "chat_stream":
            body = {
                "messages": [{"role": "user", "content": _prompt(rng, 20)}],
                "max_tokens": base["max_tokens"],
                "stream": kind == "chat_stream",
            }
            return "/v1/chat/completions", body, None, kind
        if kind == "n":
            return (
                "/v1/completions",
                {**base, "n": rng.randint(2, 3), "temperature": 0.8},
                None,
                kind,
            )
        if kind == "stop":
            return "/v1/completions", {**base, "stop": ["return", "\n\n"]}, None, kind
        if kind == "logprobs":
            return (
                "/v1/completions",
                {**base, "logprobs": 3, "echo": rng.random() < 0.5},
                None,
                kind,
            )
        near = {"prompt": _prompt(rng, 400), "max_tokens": 16}  # ~1,000 tokens of 1,024
        return "/v1/completions", near, None, kind

    async def _worker(self, client: httpx.AsyncClient, until: float):
        while time.monotonic() < until:
            path, body, cut, kind = self._body()
            outcome = await completion(client, self.server.url, body, path, cut)
            outcome["t"] = time.monotonic() - self.start
            outcome["kind"] = kind
            if outcome["status"] == 400 and kind == "near_limit":
                outcome["status"] = "400_near_limit"  # over the context: a clear 400
            self.outcomes.append(outcome)

    async def _bursts(self, client: httpx.AsyncClient, until: float):
        """Every 30 s (a third of a shorter soak), three times what the server admits."""
        period = min(30.0, self.seconds / 3)
        while time.monotonic() + period < until:
            await asyncio.sleep(period)
            bodies = [
                {"prompt": _prompt(self.rng, 8), "max_tokens": 8}
                for _ in range(3 * (MAX_RUNNING + MAX_QUEUED))
            ]
            outs = await asyncio.gather(*(completion(client, self.server.url, b) for b in bodies))
            for o in outs:
                o["t"] = time.monotonic() - self.start
                o["burst"] = True
            self.outcomes.extend(outs)

    async def _sample(self, until: float):
        """RSS of both processes and the KV usage every second (never held up by the heap
        readings, which go through the engine's loop)."""
        pid_server = self.server.proc.pid
        engine = self.server.engine_pid()
        async with httpx.AsyncClient(limits=_limits(), timeout=10) as c:
            while time.monotonic() < until:
                usage = None
                try:
                    text = (await c.get(self.server.url + "/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("mci:kv_cache_usage_perc"):
                            usage = float(line.split()[-1])
                except httpx.HTTPError:
                    pass
                self.samples.append(
                    {
                        "t": round(time.monotonic() - self.start, 2),
                        "rss_server": rss_bytes(pid_server),
                        "rss_engine": rss_bytes(engine),
                        "kv_usage": usage,
                    }
                )
                await asyncio.sleep(1.0)

    async def _sample_heap(self, until: float):
        """The engine's heap (in use, free) every HEAP_EVERY_S, where glibc reports it."""
        async with httpx.AsyncClient(limits=_limits(), timeout=30) as c:
            while time.monotonic() < until:
                try:
                    memory = (await c.get(self.server.url + "/internal/state")).json()["memory"]
                    keys = ("heap_in_use_bytes", "heap_free_bytes")
                    if all(k in memory for k in keys):
                        t = round(time.monotonic() - self.start, 2)
                        self.heap_samples.append({"t": t, **{k: memory[k] for k in keys}})
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                await asyncio.sleep(HEAP_EVERY_S)

    async def _run(self):
        self.plan = self.server.state().get("memory_plan")  # stated once, at start
        self.start = time.monotonic()
        until = self.start + self.seconds
        async with httpx.AsyncClient(timeout=CLIENT_BOUND_S, limits=_limits(512)) as client:
            await asyncio.gather(
                self._sample(until),
                self._sample_heap(until),
                self._bursts(client, until),
                *(self._worker(client, until) for _ in range(self.workers)),
            )

    def run(self) -> dict:
        asyncio.run(self._run())
        counts = tally(self.outcomes)
        kv = self.server.kv_clean()
        memory = memory_report(self.samples, self.seconds, self.plan, self.server.warmed)
        allowed = {"200_finished", "429", "cut_by_client", "400_near_limit"}
        unexpected = [o for o in self.outcomes if set(tally([o])) - allowed]
        return {
            "unexpected": unexpected[:20],  # for diagnosis: kind, time, status, message
            "seconds": self.seconds,
            "requests": len(self.outcomes),
            "counts": counts,
            "kv": kv,
            "memory": memory,
            "bursts": sum(1 for o in self.outcomes if o.get("burst")),
            "ok": bool(set(counts) <= allowed and kv["ok"] and memory["ok"]),
        }


def memory_report(samples: list[dict], seconds: float, plan: dict | None, warmed: bool) -> dict:
    """Each process's RSS after warm-up and at the end, the engine's growth, peak and slope
    over the second half, judged as the module docstring says; growth is only reported when
    the server did not warm its kernels up (they compile during the soak, by design)."""
    t = [s["t"] for s in samples]
    warm_t = min(WARMUP_MAX_S, seconds * WARMUP_SHARE)
    warm = max(1, sum(1 for x in t if x <= warm_t))
    tail = max(1, len(samples) // 10)
    report: dict = {"warmup_s": warm_t}
    for proc in ("engine", "server"):
        rss = [s[f"rss_{proc}"] for s in samples]
        warm_rss = max(rss[:warm])
        end_rss = sum(rss[-tail:]) / tail
        report[proc] = {
            "rss_warmup_bytes": warm_rss,
            "rss_end_bytes": int(end_rss),
            "rss_peak_bytes": max(rss),
            "growth_after_warmup": round((end_rss - warm_rss) / warm_rss, 4),
        }
    half = samples[len(samples) // 2 :]
    report["engine"]["slope_second_half_mb_per_hour"] = round(_slope(half) * 3600 / 2**20, 1)
    engine = report["engine"]
    bound = None if plan is None else plan["total_bytes"] + PROCESS_OWN_BYTES
    report["engine_peak_bound_bytes"] = bound
    report["growth_judged"] = warmed
    growth_ok = engine["growth_after_warmup"] < RSS_GROWTH_LIMIT or not warmed
    report["ok"] = growth_ok and bound is not None and engine["rss_peak_bytes"] <= bound
    return report


def _slope(samples: list[dict]) -> float:
    """Least-squares slope of the engine's RSS over time, bytes per second."""
    if len(samples) < 2:
        return 0.0
    xs = [s["t"] for s in samples]
    ys = [s["rss_engine"] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


async def _in_flight_during_sigterm(server: Server, rng: random.Random) -> list[dict]:
    async with httpx.AsyncClient(limits=_limits(), timeout=CLIENT_BOUND_S) as c:
        bodies = [
            {
                "prompt": _prompt(rng, 10),
                # still running when the late request comes, however fast decoding is: most
                # of the context (~1 ms a token here at best)
                "max_tokens": CONTEXT - 100,
                "ignore_eos": True,
                "stream": bool(i % 2),
            }
            for i in range(6)
        ]
        tasks = [asyncio.ensure_future(completion(c, server.url, b)) for b in bodies]
        await asyncio.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        late = await completion(c, server.url, {"prompt": "x", "max_tokens": 2})
        return [*(await asyncio.gather(*tasks)), {**late, "late": True}]


def sigterm_drain(server: Server, rng: random.Random) -> dict:
    outcomes = asyncio.run(_in_flight_during_sigterm(server, rng))
    code = server.proc.wait(60)
    in_flight = tally([o for o in outcomes if not o.get("late")])
    late = [o for o in outcomes if o.get("late")][0]["status"]
    return {
        "in_flight": in_flight,
        "late_request_status": late,
        "exit_code": code,
        "ok": set(in_flight) == {"200_finished"} and late == 503 and code == 0,
    }


def plot(samples: list[dict], heap_samples: list[dict], outcomes: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    t = [s["t"] for s in samples]
    ax1.plot(t, [s["rss_server"] / 2**20 for s in samples], label="front end")
    ax1.plot(t, [s["rss_engine"] / 2**20 for s in samples], label="engine")
    heap = heap_samples
    ax1.plot(
        [s["t"] for s in heap],
        [s["heap_in_use_bytes"] / 2**20 for s in heap],
        label="engine heap in use",
    )
    ax1.plot(
        [s["t"] for s in heap],
        [s["heap_free_bytes"] / 2**20 for s in heap],
        label="engine heap free (kept)",
    )
    ax1.set_ylabel("MiB")
    ax1.legend()
    ax2.plot(t, [100 * (s["kv_usage"] or 0) for s in samples])
    ax2.set_ylabel("KV usage (%)")
    buckets: dict[str, Counter] = {}
    for o in outcomes:
        kind = tally([o]).popitem()[0]
        buckets.setdefault(kind, Counter())[int(o["t"] // 10) * 10] += 1
    for kind, by_t in sorted(buckets.items()):
        xs = sorted(by_t)
        ax3.plot(xs, [by_t[x] for x in xs], marker=".", label=kind)
    ax3.set_ylabel("requests per 10 s")
    ax3.set_xlabel("soak time (s)")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--soak-seconds", type=float, default=600)
    parser.add_argument("--out", type=Path, default=Path("chaos-results"))
    parser.add_argument("--model-path", default=None, help="default: the bundled model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--soak-workers", type=int, default=SOAK_WORKERS)
    parser.add_argument(
        "--soak-only", action="store_true", help="the soak alone (a long memory soak)"
    )
    parser.add_argument(
        "--skip-kernel-warmup",
        action="store_true",
        help="start the server without it (faster; the soak then reports growth unjudged)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    report: dict = {"soak_seconds": args.soak_seconds, "seed": args.seed}
    server = Server(args.out, args.model_path, args.skip_kernel_warmup)
    phases = (
        ("disconnect_storm", lambda: asyncio.run(disconnect_storm(server, rng))),
        ("overload", lambda: asyncio.run(overload(server, rng))),
        ("malformed", lambda: asyncio.run(malformed(server, rng))),
        ("engine_signals", lambda: engine_signals(server, rng)),
    )
    try:
        for name, run in () if args.soak_only else phases:
            started, before = time.monotonic(), server.engine_generation()
            report[name] = run()
            report[name]["wall_s"] = round(time.monotonic() - started, 1)
            if name != "engine_signals":  # nothing else may crash or hang the engine
                undisturbed = server.engine_generation() == before
                report[name]["engine_undisturbed"] = undisturbed
                report[name]["ok"] = report[name]["ok"] and undisturbed
            print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'}", flush=True)
        soak = Soak(server, rng, args.soak_seconds, args.soak_workers)
        before = server.engine_generation()
        report["soak"] = soak.run()
        report["soak"]["engine_undisturbed"] = server.engine_generation() == before
        report["soak"]["ok"] = report["soak"]["ok"] and report["soak"]["engine_undisturbed"]
        memory = report["soak"]["memory"]
        print(
            f"soak: {'ok' if report['soak']['ok'] else 'FAILED'}; engine RSS "
            f"{memory['engine']['rss_warmup_bytes'] / 2**20:.0f} -> "
            f"{memory['engine']['rss_end_bytes'] / 2**20:.0f} MiB "
            f"({100 * memory['engine']['growth_after_warmup']:+.1f}%), slope "
            f"{memory['engine']['slope_second_half_mb_per_hour']:+.1f} MB/h",
            flush=True,
        )
        report["soak_samples"] = soak.samples
        report["soak_heap_samples"] = soak.heap_samples
        plot(soak.samples, soak.heap_samples, soak.outcomes, args.out / "chaos.png")
        report["sigterm_drain"] = sigterm_drain(server, rng)
        print(f"sigterm_drain: {'ok' if report['sigterm_drain']['ok'] else 'FAILED'}")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)
        server.log.close()
    checks = [k for k, v in report.items() if isinstance(v, dict) and "ok" in v]
    report["ok"] = all(report[k]["ok"] for k in checks)
    (args.out / "chaos.json").write_text(json.dumps(report, indent=1))
    print(f"{'passed' if report['ok'] else 'FAILED'}: {args.out / 'chaos.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
