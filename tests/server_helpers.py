"""Start and stop a real `mci serve` on 127.0.0.1 for tests."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """A free port whose next `count - 1` ports are free too (`--dp-size N` puts its replicas
    on the ports after --port; any one of them may be another socket's, e.g. a client's)."""
    for _ in range(200):
        base = free_port()
        if all(_bindable(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no run of {count} free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class DrainedOutput:
    """A child's stdout (and stderr, merged into it), read in a thread as it comes: a server
    that logs must never block on its pipe, which the test reads only at the end, if at all
    (a 64 KB pipe fills after a few tracebacks, and a server blocked writing one answers
    nothing). Keeps the last MAX_LINES lines."""

    MAX_LINES = 20_000

    def __init__(self, stream):
        self._lines: collections.deque[str] = collections.deque(maxlen=self.MAX_LINES)
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.append(line)

    def text(self, ended: bool = False) -> str:
        """What was printed so far; `ended`: the process has exited, so wait (5 s at most)
        until all of it was read."""
        if ended:
            self._reader.join(5)
        return "".join(self._lines)


class LiveServer:
    """`mci serve` (or another serving command: `mci router`, or words of one such as
    ("workflow", "serve", "FILE:ENTRY")) in a subprocess, with `env` added to its
    environment; `url` is its base URL. Use as a context manager."""

    def __init__(
        self,
        model_path,
        *flags: str,
        startup_s: float = 120,
        dtype: str = "float32",
        command: str | tuple[str, ...] = "serve",
        port: int | None = None,
        env: dict | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        words = (command,) if isinstance(command, str) else command
        cmd = [sys.executable, "-m", "mci", *words, "--port", str(self.port), *flags]
        if command in ("serve", "serve-ray") and "--skip-kernel-warmup" not in flags:
            cmd.append("--skip-kernel-warmup")  # seconds per server; no test times first requests
        if model_path is not None:  # None: the bundled default model, as `make run` serves
            cmd += ["--model-path", str(model_path), "--dtype", dtype]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",  # a stray byte must not stop DrainedOutput's reader
            env={**os.environ, **(env or {})},
        )
        self.log = DrainedOutput(self.proc.stdout)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.text(ended=True)}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def state(self) -> dict:
        return httpx.get(self.url + "/internal/state", timeout=10).json()

    def metric(self, prefix: str) -> float:
        """The sum of the /metrics samples whose line starts with `prefix` (a name and its
        opening brace, or a name with its labels)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))

    def wait_idle(self, timeout_s: float = 20) -> dict:
        """Poll until nothing is in flight; returns the engine state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            handoff = state.get("disaggregation") or {}
            transfers = ("receiving", "held_tokens", "quarantined_slots")
            if (
                state["in_flight"] == 0
                and state["num_running"] == 0
                and state["num_waiting"] == 0
                and not any(handoff.get(k) for k in transfers)
            ) or time.monotonic() > deadline:
                return state
            time.sleep(0.1)

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def complete_into(url: str, prompt: str, max_tokens: int, results: dict, key) -> None:
    """One greedy completion (EOS ignored), e.g. in a thread: results[key] = (status, body,
    headers), or (None, the error, None) when the connection failed."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        r = httpx.post(url + "/v1/completions", timeout=120, json=body)
        results[key] = (r.status_code, r.json(), r.headers)
    except httpx.HTTPError as exc:
        results[key] = (None, str(exc), None)


def wait_for_state(url: str, ready, timeout_s: float = 60) -> dict:
    """Poll the engine's live state (/internal/state) until `ready(state)`; returns it. Tests
    that must catch a request mid-way wait for this, not for fixed times: `tiny` decodes
    1,500 tokens in under 2 s on a fast machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.get(url + "/internal/state", timeout=10)
        state = reply.json()
        if reply.status_code == 200 and ready(state):  # 503 while no engine runs
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"engine state never became ready: {state}")
        time.sleep(0.02)


def long_request_then_queued(
    url: str, prompts: list[str], results: dict, send=complete_into, max_tokens: int = 1500
):
    """On a server with --max-running-requests 1: a `max_tokens` request (key "long", sent by
    `send`) that runs alone and has produced tokens, then `prompts` queued behind it (8 tokens
    each, keys 0..n-1), all waiting. Returns the threads: (long, queued)."""
    generated = wait_for_state(url, lambda s: True)["counters"].get("generation_tokens", 0)
    long = threading.Thread(target=send, args=(url, "x", max_tokens, results, "long"))
    long.start()
    wait_for_state(url, lambda s: s["counters"].get("generation_tokens", 0) > generated)
    queued = [
        threading.Thread(target=complete_into, args=(url, p, 8, results, i))
        for i, p in enumerate(prompts)
    ]
    for t in queued:
        t.start()
    wait_for_state(url, lambda s: s["num_waiting"] == len(prompts))
    return long, queued


def processes_titled(title: str) -> list[int]:
    """Pids of the processes whose command line contains `title` (Ray Serve replicas show
    `ServeReplica:APP:DEPLOYMENT` there)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if title.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids
