"""`mci workflow deploy` on a local Ray cluster (loopback): each step its own deployment with
its own replica count, the examples' outputs equal to `mci workflow run`'s, and a step
replica SIGKILLed under load: every request completes or fails with a typed error within its
deadline, none hangs.

Slow (a Ray cluster on 2 cores): `make test-ray` runs it in its own venv with Ray Serve.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import DrainedOutput, free_port, processes_titled

pytestmark = pytest.mark.slow
pytest.importorskip("ray.serve", reason="Ray Serve is the 'ray' extra: make test-ray")

ROOT = Path(__file__).resolve().parents[1]
KILL = Path(__file__).parent / "workflows" / "ray_kill.py"
STARTUP_S = 240


def replica_pids(app: str, step: str) -> list[int]:
    """Pids of the Ray Serve replicas of one step's deployment."""
    return processes_titled(f"ServeReplica:{app}:{step}")


class Deployed:
    """`mci workflow deploy FILE:ENTRY` in a subprocess, up once a request succeeds."""

    def __init__(self, target: str, probe: dict, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = ["workflow", "deploy", target, "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mci", *command],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",  # a stray byte must not stop DrainedOutput's reader
        )
        self.log = DrainedOutput(self.proc.stdout)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"deploy exited: {self.log.text(ended=True)[-3000:]}")
            try:
                if httpx.post(self.url + "/run", json=probe, timeout=60).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError("the workflow did not come up")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def sse_items(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def local_run(target: str, value: dict) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "mci", "workflow", "run", target, "--input", json.dumps(value)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_the_examples_deploy_one_deployment_per_step_and_answer_as_run_does():
    repair_in = {
        "signature": "def add(a, b):",
        "docstring": "Return a + b.",
        "test": "assert add(2, 3) == 5",
        "max_tokens": 24,
    }
    pipeline_in = {"prompt": "import os\n", "draft_tokens": 24, "continuation_tokens": 4}
    for target, value, steps in (
        ("examples/code_repair/workflow.py:RepairCode", repair_in, ("WriteCode", "CheckCode")),
        ("examples/two_models/workflow.py:Pipeline", pipeline_in, ("Draft", "Pipeline")),
    ):
        app = "workflow-" + target.rsplit(":", 1)[1]
        deployed = Deployed(target, value)
        try:
            for step in steps:
                assert len(replica_pids(app, step)) == 1, step
            response = httpx.post(deployed.url + "/run", json=value, timeout=120)
            assert response.status_code == 200
            items = sse_items(response)
        finally:
            assert deployed.stop() == 0
        expected = local_run(target, value)
        drop_times = [{k: v for k, v in i.items() if k != "t_s"} for i in items]
        assert drop_times == [{k: v for k, v in i.items() if k != "t_s"} for i in expected]
    assert not replica_pids("workflow-Pipeline", "Draft")  # SIGTERM removed the application


def test_a_replica_killed_under_load_fails_no_request_silently_and_none_hangs():
    deadline_s = 20.0
    receiver = OtlpReceiver()
    flags = ("--otlp-traces-endpoint", receiver.endpoint)
    deployed = Deployed(f"{KILL}:Front", {"text": "x", "max_tokens": 2}, *flags)
    outcomes: list[tuple[str, float]] = []
    try:
        # one trace across the processes: ingress -> Front's replica -> Writer's -> its model
        trace_id = "0af7651916cd43dd8448eb211c80319c"
        traced = httpx.post(
            deployed.url + "/run",
            json={"text": "z", "max_tokens": 3},
            headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
            timeout=60,
        )
        assert traced.status_code == 200
        wanted = {"workflow Front", "step Front", "step Writer", "model default-model"}
        spans = receiver.wait_for(
            lambda ss: wanted <= {x["name"] for x in ss if x["trace_id"] == trace_id}, 20
        )
        mine = {x["name"]: x for x in spans if x["trace_id"] == trace_id}
        assert wanted <= set(mine), set(mine)
        assert mine["step Writer"]["parent_span_id"] == mine["step Front"]["span_id"]
        assert mine["model default-model"]["parent_span_id"] == mine["step Writer"]["span_id"]
        assert mine["model default-model"]["attributes"]["gen_ai.usage.output_tokens"] == 3

        writers = replica_pids("workflow-Front", "Writer")
        assert len(writers) == 2  # the step's own replica count

        def one(i: int) -> tuple[str, float]:
            start = time.monotonic()
            response = httpx.post(
                deployed.url + "/run",
                json={"text": f"def f{i}(x):", "max_tokens": 48},
                headers={"X-Request-Timeout": str(deadline_s)},
                timeout=deadline_s + 10,
            )
            took = time.monotonic() - start
            if response.status_code == 200:
                return "ok", took
            error = response.json()["error"]  # typed: a code and the failing step
            assert error["code"] and error["step"], response.text
            return f"{response.status_code} {error['code']} in {error['step']}", took

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(48)]
            time.sleep(3)
            os.kill(writers[0], signal.SIGKILL)
            outcomes = [f.result() for f in futures]
        after = httpx.post(deployed.url + "/run", json={"text": "y", "max_tokens": 4}, timeout=60)
        assert after.status_code == 200  # the survivor (and the replacement) serve on
    finally:
        deployed.stop()
        receiver.close()
    print("outcomes:", {o: sum(1 for x, _ in outcomes if x == o) for o, _ in outcomes})
    assert len(outcomes) == 48
    assert all(took < deadline_s + 1 for _, took in outcomes)  # none hung past its deadline
    assert sum(o == "ok" for o, _ in outcomes) >= 44  # Writer is retried 3 times
