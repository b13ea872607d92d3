#!/usr/bin/env python3
"""Workflow figures (docs/workflows.md), each part on its own:

  pipeline  the two-model example (examples/two_models) in process: time to the first output
            of the last step vs the first step's total latency, and end-to-end latency vs the
            same chain run step after step (the script a user writes by hand, on the same
            engines); p50/p99 over --requests requests, outputs checked equal
  overhead  a one-step workflow around one model call vs the call itself: in process
            (LocalWorkflow vs the ModelClient), and over HTTP (`mci workflow serve` in front
            of `mci serve` vs `mci serve` directly), calls alternating; added p50/p99
  deadline  a chain longer than its deadline, in process: |failure time - deadline| and the
            engine's KV free again after each
  ray       (run with .venv-ray) overhead on Ray Serve (`mci workflow deploy` vs `mci serve`),
            and a step replica SIGKILLed under load: outcomes and latencies

    python benchmarks/workflow.py --parts pipeline,overhead,deadline
    .venv-ray/bin/python benchmarks/workflow.py --parts ray

The model is the bundled default model (bf16 and its FP8 twin); prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BASIC = ROOT / "tests" / "workflows" / "basic.py"
KILL = ROOT / "tests" / "workflows" / "ray_kill.py"
sys.path.insert(0, str(ROOT))
from tests.server_helpers import free_port, processes_titled  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": round(pct(ms, 50), 2), "p99_ms": round(pct(ms, 99), 2), "n": len(ms)}


def prompts(n: int) -> list[str]:
    heads = ["import os\n", "import sys\n", "class Node:\n", "def main():\n", "from typing import"]
    return [f"# module {i}\n{heads[i % len(heads)]}" for i in range(n)]


# ---- pipeline -----------------------------------------------------------------------------------
async def pipeline(n: int) -> dict:
    from mci.workflow.local import LocalWorkflow
    from mci.workflow.steps import load_entry

    workflow = LocalWorkflow(load_entry(str(ROOT / "examples/two_models/workflow.py:Pipeline")))
    await workflow.start()
    draft_model = workflow.models.client(workflow.specs["Draft"].models["llm"])
    second_model = workflow.models.client(workflow.specs["Pipeline"].models["llm"])
    rows = {
        "first_last_step": [],
        "first_step_total": [],
        "e2e": [],
        "seq_e2e": [],
        "seq_first": [],
    }
    mismatches = 0
    try:
        for prompt in prompts(3) + prompts(n):  # the first 3: warm-up, not counted
            body = {"prompt": prompt, "draft_tokens": 48, "continuation_tokens": 8}
            start = time.monotonic()
            first_cont = last_draft = None
            got = []
            async for seg in workflow.entry.stream(body):
                now = time.monotonic() - start
                got.append((seg.kind, seg.text))
                if seg.kind == "continuation" and first_cont is None:
                    first_cont = now
                if seg.kind == "draft":
                    last_draft = now
            e2e = time.monotonic() - start
            # the same chain step after step: the whole draft, then each continuation
            start = time.monotonic()
            draft = await draft_model.complete(prompt, max_tokens=48)
            expected, so_far, seq_first = [], prompt, None
            lines = draft.text.splitlines(keepends=True)
            for line in lines:
                so_far += line
                more = await second_model.complete(so_far, max_tokens=8)
                seq_first = seq_first or time.monotonic() - start
                expected += [("draft", line), ("continuation", more.text)]
            seq_e2e = time.monotonic() - start
            mismatches += got != expected
            if prompt in prompts(3):
                continue
            for key, value in (
                ("first_last_step", first_cont),
                ("first_step_total", last_draft),
                ("e2e", e2e),
                ("seq_e2e", seq_e2e),
                ("seq_first", seq_first),
            ):
                rows[key].append(value)
    finally:
        await workflow.close()
    return {
        "part": "pipeline",
        "mismatches": mismatches,
        **{k: summary(v) for k, v in rows.items()},
    }


# ---- servers ------------------------------------------------------------------------------------
def start(cmd: list[str], url: str, env: dict | None = None, probe=None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mci", *cmd],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited")
        try:
            ok = probe() if probe else httpx.get(url + "/health", timeout=2).status_code == 200
            if ok:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{cmd} did not come up")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


def alternate(calls: dict, n: int) -> dict:
    """Each callable n times, alternating (drift hits both alike); seconds per call."""
    times = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return times


def added(times: dict, base: str, other: str) -> dict:
    return {
        base: summary(times[base]),
        other: summary(times[other]),
        "added_p50_ms": round((pct(times[other], 50) - pct(times[base], 50)) * 1000, 2),
        "added_p99_ms": round((pct(times[other], 99) - pct(times[base], 99)) * 1000, 2),
    }


def http_overhead(n: int, deploy: bool) -> dict:
    server_port, wf_port = free_port(), free_port()
    server_url, wf_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{wf_port}"
    server = start(["serve", "--port", str(server_port)], server_url)
    body = {"text": "def f(x):", "max_tokens": 4}
    completion = {**body, "prompt": body["text"], "temperature": 0, "ignore_eos": True}
    completion.pop("text")
    client = httpx.Client(timeout=60)

    def probe():
        return client.post(wf_url + "/run", json=body).status_code == 200

    cmd = ["workflow", "deploy" if deploy else "serve", f"{BASIC}:Once", "--port", str(wf_port)]
    wf = start(cmd, wf_url, {"MCI_TEST_MODEL_URL": server_url}, probe=probe)
    try:
        calls = {
            "direct": lambda: client.post(server_url + "/v1/completions", json=completion),
            "workflow": lambda: client.post(wf_url + "/run", json=body),
        }
        alternate(calls, 10)  # warm-up
        return added(alternate(calls, n), "direct", "workflow")
    finally:
        stop(wf)
        stop(server)


async def local_overhead(n: int) -> dict:
    from mci.workflow.local import LocalWorkflow
    from mci.workflow.steps import load_entry

    os.environ.pop("MCI_TEST_MODEL_URL", None)
    os.environ["MCI_TEST_MODEL_PATH"] = str(ROOT / "mci" / "assets" / "default-model")
    workflow = LocalWorkflow(load_entry(f"{BASIC}:Once"))
    await workflow.start()
    llm = workflow.models.client(workflow.specs["Once"].models["llm"])
    times = {"direct": [], "workflow": []}
    try:
        for i in range(n + 10):
            for name in times:
                t = time.perf_counter()
                if name == "direct":
                    await llm.complete("def f(x):", max_tokens=4, ignore_eos=True)
                else:
                    await workflow.entry.call({"text": "def f(x):", "max_tokens": 4})
                if i >= 10:
                    times[name].append(time.perf_counter() - t)
    finally:
        await workflow.close()
    return added(times, "direct", "workflow")


# ---- deadline -----------------------------------------------------------------------------------
async def deadline(n: int, deadline_s: float) -> dict:
    from mci.workflow.errors import WorkflowError
    from mci.workflow.local import LocalWorkflow
    from mci.workflow.steps import load_entry

    os.environ.pop("MCI_TEST_MODEL_URL", None)
    os.environ["MCI_TEST_MODEL_PATH"] = str(ROOT / "mci" / "assets" / "default-model")
    workflow = LocalWorkflow(load_entry(f"{BASIC}:Collect"))
    await workflow.start()
    engine = workflow.models.engines()[0]
    errors, kinds, free_after = [], {}, []
    try:
        for _ in range(n):
            body = {"text": "x", "max_tokens": 2000, "pause_s": 0.01}
            start = time.monotonic()
            try:
                await workflow.entry.call(body, timeout_s=deadline_s)
                kinds["completed"] = kinds.get("completed", 0) + 1
            except WorkflowError as err:
                kinds[err.kind] = kinds.get(err.kind, 0) + 1
            errors.append(time.monotonic() - start - deadline_s)
            t = time.monotonic()
            while engine.stats()["num_running"]:
                await asyncio.sleep(0.001)
            engine.check_idle_integrity()  # every slot free or the tree's, no lock held
            free_after.append(time.monotonic() - t)
    finally:
        await workflow.close()
    return {
        "part": "deadline",
        "deadline_s": deadline_s,
        "outcomes": kinds,
        "late_ms": summary(errors),
        "max_abs_ms": round(max(abs(e) for e in errors) * 1000, 1),
        "kv_free_after_ms": summary(free_after),
    }


# ---- Ray: a replica killed under load -----------------------------------------------------------
def ray_kill(total: int, clients: int, deadline_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    probe_body = {"text": "x", "max_tokens": 2}

    def probe():
        return httpx.post(url + "/run", json=probe_body, timeout=60).status_code == 200

    proc = start(["workflow", "deploy", f"{KILL}:Front", "--port", str(port)], url, probe=probe)
    pids = processes_titled("ServeReplica:workflow-Front:Writer")

    def one(i: int):
        t = time.monotonic()
        try:
            r = httpx.post(
                url + "/run",
                json={"text": f"def f{i}(x):", "max_tokens": 48},
                headers={"X-Request-Timeout": str(deadline_s)},
                timeout=deadline_s + 10,
            )
            outcome = (
                "ok" if r.status_code == 200 else f"{r.status_code} {r.json()['error']['code']}"
            )
        except httpx.TimeoutException:
            outcome = "hung"
        return outcome, time.monotonic() - t

    try:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(one, i) for i in range(total)]
            time.sleep(3)
            os.kill(pids[0], signal.SIGKILL)
            results = [f.result() for f in futures]
    finally:
        stop(proc)
    counts: dict = {}
    for outcome, _ in results:
        counts[outcome] = counts.get(outcome, 0) + 1
    return {
        "part": "ray_kill",
        "writer_replicas": len(pids),
        "outcomes": counts,
        "latency": summary([t for _, t in results]),
        "max_s": round(max(t for _, t in results), 2),
        "deadline_s": deadline_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="pipeline,overhead,deadline")
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "pipeline" in parts:
        print(json.dumps(asyncio.run(pipeline(args.requests))), flush=True)
    if "overhead" in parts:
        print(
            json.dumps({"part": "overhead_in_process", **asyncio.run(local_overhead(200))}),
            flush=True,
        )
        print(json.dumps({"part": "overhead_http", **http_overhead(200, deploy=False)}), flush=True)
    if "deadline" in parts:
        print(json.dumps(asyncio.run(deadline(20, 0.5))), flush=True)
    if "ray" in parts:
        print(json.dumps({"part": "overhead_ray", **http_overhead(200, deploy=True)}), flush=True)
        print(json.dumps(ray_kill(96, 8, 20.0)), flush=True)


if __name__ == "__main__":
    main()
