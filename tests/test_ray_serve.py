"""`mci serve-ray` on a local Ray cluster (loopback): Serve's autoscaler takes the replica
deployment from 1 to 2 replicas under load, the cache-aware request router keeps each prompt
family on one replica, outputs equal a single replica's, and SIGTERM stops everything.

Slow (a Ray cluster on 2 cores): `make test-ray` runs it in its own venv with Ray Serve.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import free_port

pytestmark = pytest.mark.slow
pytest.importorskip("ray.serve", reason="Ray Serve is the 'ray' extra: make test-ray")

STARTUP_S = 180
SCALE_UP_S = 180


def _replica_processes() -> set[int]:
    """Pids of Ray Serve replica actors and of the mci servers they started."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"ServeReplica:mci" in cmdline or b"multiprocessing.spawn" in cmdline:
            pids.add(int(entry.name))
    return pids


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int):
    """One greedy streamed completion: (text, replica, finish_reason)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, finish = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        replica = r.headers["x-mci-replica"]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return "".join(text), replica, finish


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "serve-ray did not become healthy"
        time.sleep(1)


def _replicas_running(url: str) -> int:
    status = httpx.get(url + "/ray/status", timeout=30).json()
    return status["mci"]["mci-replica"]["replica_states"].get("RUNNING", 0)


def test_serve_ray_autoscales_routes_by_cache_and_stops(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve-ray.log", "w")  # Ray logs every request: never a pipe
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "mci", "serve-ray", "--port", str(port),
            "--min-replicas", "1", "--max-replicas", "2",
            "--target-ongoing-requests", "2", "--upscale-delay-s", "1",
            "--downscale-delay-s", "600", "--cpus-per-replica", "1", "--skip-kernel-warmup",
            # fp32: greedy text must not depend on the batch (bf16 near-ties can flip where
            # the CPU runs no batch-invariant bf16 kernels)
            "--dtype", "float32",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_healthy(proc, url, tmp_path / "serve-ray.log")
        assert _replicas_running(url) == 1

        # under 8 concurrent streams (target: 2 per replica) Serve adds the second replica
        prompts = [f"def function_{i}(x):\n    return" for i in range(8)]

        async def load_until_scaled():
            expected: dict[str, str] = {}
            async with httpx.AsyncClient(timeout=120) as client:
                scale_deadline = time.monotonic() + SCALE_UP_S
                while True:
                    results = await asyncio.gather(*(_stream(client, url, p, 48) for p in prompts))
                    for prompt, (text, _, finish) in zip(prompts, results):
                        assert finish == "length"
                        assert expected.setdefault(prompt, text) == text  # greedy: the same
                    if await asyncio.to_thread(_replicas_running, url) == 2:
                        return expected
                    assert time.monotonic() < scale_deadline, "no second replica under load"

        expected = asyncio.run(load_until_scaled())

        # new prompt families with long shared prefixes: each family stays on one replica,
        # and the new (empty) replica takes families too
        families = [
            f"# module {name}\n" + "".join(f"{name}_{j} = {j} * {j}\n" for j in range(30))
            for name in ("alpha", "bravo", "charlie", "delta")
        ]

        async def route_families():
            seen: dict[int, set[str]] = {}
            async with httpx.AsyncClient(timeout=120) as client:
                for round_ in range(3):
                    for f, prefix in enumerate(families):
                        _, replica, _ = await _stream(client, url, prefix + f"x{round_} =", 4)
                        seen.setdefault(f, set()).add(replica)
                # a prompt served before gives the same text on whichever replica has it now
                for prompt in prompts[:2]:
                    text, _, _ = await _stream(client, url, prompt, 48)
                    assert text == expected[prompt]
            return seen

        seen = asyncio.run(route_families())
        assert all(len(replicas) == 1 for replicas in seen.values()), seen
        assert len(set().union(*seen.values())) == 2, seen

        replica_pids = _replica_processes()
        assert replica_pids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        deadline = time.monotonic() + 30
        while replica_pids & _replica_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not replica_pids & _replica_processes(), "replica processes outlived serve-ray"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def test_serve_ray_deploys_prefill_and_decode_as_two_deployments(tmp_path):
    """--pd-disaggregation: mci-prefill and mci-decode, each its own deployment with its own
    replica count, one ingress that pairs them; the answers equal a colocated engine's."""
    from mci.core.sampling_params import SamplingParams
    from mci.engine.config import engine_config_from_fields
    from mci.engine.engine import Engine

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve-ray.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "mci", "serve-ray", "--port", str(port),
            "--pd-disaggregation", "--prefill-min-replicas", "1", "--prefill-max-replicas", "1",
            "--min-replicas", "1", "--max-replicas", "1", "--cpus-per-replica", "1",
            "--skip-kernel-warmup", "--dtype", "float32",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_healthy(proc, url, tmp_path / "serve-ray.log")
        # /health answers once a decode replica does (decode alone can serve); the prefill
        # replica may still be starting then
        deadline = time.monotonic() + STARTUP_S
        while True:
            status = httpx.get(url + "/ray/status", timeout=30).json()["mci"]
            states = [status[name]["replica_states"] for name in ("mci-prefill", "mci-decode")]
            if all(state.get("RUNNING") for state in states):
                break
            assert time.monotonic() < deadline, status
            time.sleep(1)
        assert set(status) == {"mci-ingress", "mci-prefill", "mci-decode"}
        assert status["mci-prefill"]["replica_states"].get("RUNNING") == 1
        assert status["mci-decode"]["replica_states"].get("RUNNING") == 1
        prompts = ["def fibonacci(n):", "import os\nimport sys\n" * 10]
        config = engine_config_from_fields({"dtype": "float32", "skip_kernel_warmup": True})
        with Engine(config) as engine:
            params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
            want = engine.generate(prompts, params)

        async def through_ray():
            async with httpx.AsyncClient(timeout=120) as client:
                return [await _stream(client, url, p, 12) for p in prompts]

        got = asyncio.run(through_ray())
        assert [text for text, _, _ in got] == [w.outputs[0].text for w in want]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
